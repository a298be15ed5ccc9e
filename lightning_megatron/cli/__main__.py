"""`python -m lightning_megatron.cli fit ...` (what `torchrun -m` needs): the `lightning-megatron` command."""

import sys

from lightning_megatron.cli import COMMANDS, main

sys.argv[0] = COMMANDS[0].script or sys.argv[0]  # `--help` names the command, not `__main__.py`
main()
