"""`python -m lightning_megatron.cli fit ...` (what `torchrun -m` needs): the `lightning-megatron` command."""

from lightning_megatron.cli import main

main()
