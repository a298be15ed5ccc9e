"""`lightning-megatron-restore-mtp`: put an MTP head back into an HF checkpoint exported without one.

    lightning-megatron-restore-mtp FINETUNED OUTPUT --source ORIGINAL
    lightning-megatron-restore-mtp FINETUNED OUTPUT --init copy-last-layer

Imports neither Megatron-Core nor Lightning: only safetensors are read and written (`lightning_megatron.mtp.restore`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_megatron.mtp.restore import INITS, MTPRestoreError, restore_mtp_head


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-megatron-restore-mtp",
        description="Write a copy of an HF checkpoint exported without its MTP head, with the MTP head restored.",
    )
    parser.add_argument("finetuned", metavar="FINETUNED", type=Path, help="the checkpoint exported with mtp=False")
    parser.add_argument("output", metavar="OUTPUT", type=Path, help="the folder to write (written atomically)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--source", type=Path, help="the checkpoint the fine-tuning started from (it has the MTP head)")
    mode.add_argument("--init", choices=INITS, help="make a fresh MTP head instead")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tensors of --init (default 0)")
    args = parser.parse_args(argv)
    try:
        path = restore_mtp_head(args.finetuned, args.output, source=args.source, init=args.init, seed=args.seed)
    except MTPRestoreError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
