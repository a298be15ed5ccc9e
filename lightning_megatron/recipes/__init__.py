"""Recipes: the data and models that the project's benchmarks are run on, made locally from what every machine has."""
