"""Run a test body in several gloo processes, the way torchrun would, and collect what each rank returns; or in one
fresh process."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], tmp_path: Path, *args: Any, world_size: int = 2) -> list[Any]:
    """Spawn `world_size` processes running `fn(rank, world_size, *args)`; returns each rank's result in rank order.

    `fn` must be a module-level function (spawned processes import it). A failure in any rank fails the test with
    that rank's traceback.
    """
    out_dir = tmp_path / "rank_results"
    out_dir.mkdir(exist_ok=True)
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args, str(out_dir)), nprocs=world_size,
                       start_method="spawn", join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def run_in_fresh_process(fn: Callable[..., None], tmp_path: Path, *args: str) -> Any:
    """Spawn one process running `fn(*args, out)` (a fresh CUDA context; `fn` sets up its own process group, as a
    single-GPU run does) and return what it saved to `out` with `torch.save`; a crash fails the test."""
    out = tmp_path / "results.pt"
    process = mp.get_context("spawn").Process(target=fn, args=(*args, str(out)))
    process.start()
    process.join()
    assert process.exitcode == 0, f"the spawned process exited with {process.exitcode}"
    return torch.load(out, weights_only=False)
