"""Two gloo processes in which a collective finishes as one of them exits:
`python -m tests._exit_race ROLE WORKDIR PORT ENDING` (WORKDIR holds the FIFO `release`).

ROLE "leaving" (rank 0) starts an all-reduce of a tensor it keeps and exits with status 143, through
`exit_before_finalization` (ENDING "before_finalization") or through `SystemExit` alone ("finalize"). Its part of
the all-reduce waits for the peer (ROLE "peer", rank 1), which joins it once WORKDIR/exiting exists: that file is
written by the leaving process's last exit handler but one; the last one (a C function: no Python code runs between
it and the interpreter's finalization) keeps the GIL until the peer, a while after the all-reduce, opens
WORKDIR/release. So the gloo worker thread that finishes the all-reduce waits for the GIL (to release the tensor's
Python object) from before the interpreter finalizes until after: the window that a worker thread descheduled at
the wrong moment opens by chance in a training process that exits right after its last collectives.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import time
from pathlib import Path

WAIT_S = 60.0  # a bound on every wait, for when the other process is gone
WORKER_S = 1.0  # how long the peer gives the leaving process's worker thread to finish the collective


class WaitWhileFinalizing:
    """Collected as `__main__`'s globals are cleared, while the interpreter finalizes: keeps the process alive until a
    thread left waiting for the GIL is ended by CPython (within 5 ms)."""

    def __init__(self) -> None:
        self.sleep, self.wait_s = time.sleep, WAIT_S  # the modules' names may be gone by then

    def __del__(self) -> None:
        self.sleep(self.wait_s)


def main(role: str, workdir: Path, port: str, ending: str) -> None:
    if role == "leaving":  # before torch registers its exit handlers: these two run last
        atexit.register(ctypes.PyDLL(None).open, str(workdir / "release").encode(), os.O_RDONLY)  # GIL kept
        atexit.register((workdir / "exiting").touch)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=["leaving", "peer"].index(role), world_size=2)
    if role == "peer":
        deadline = time.monotonic() + WAIT_S
        while not (workdir / "exiting").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.all_reduce(torch.ones(1))
        time.sleep(WORKER_S)
        with open(workdir / "release", "wb"):  # lets the leaving process's last exit handler return
            os._exit(0)
    global kept
    kept = torch.ones(1)  # a tensor Python holds until it finalizes, as a model's
    dist.all_reduce(kept, async_op=True)
    if ending == "before_finalization":
        from lightning_megatron.distributed import exit_before_finalization

        exit_before_finalization(143)
    raise SystemExit(143)


if __name__ == "__main__":
    waiting = WaitWhileFinalizing() if sys.argv[1] == "leaving" else None
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4])
