"""Megatron-Core as a first-class PyTorch Lightning citizen."""

__version__ = "0.1.0"
