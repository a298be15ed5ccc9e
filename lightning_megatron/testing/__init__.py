"""Tiny HF checkpoints and data made locally (no downloads), for the tests, the demo and the benchmarks.

Nothing is imported here: each module names what it makes.
"""
