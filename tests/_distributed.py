"""Run a test body in several gloo processes, the way torchrun would, and collect what each rank returns; or in one
fresh process.

On a machine without CUDA the ranks are forked from a server process that imported torch, Megatron-Core,
transformers and Lightning once (`multiprocessing`'s forkserver): a spawned rank spends ~8 s of its core importing
them, most of a two-process test's time on the CI's two cores, and ~2 s more on what megatron-bridge imports
(`tests/_forkserver_preload.py`). The rank is otherwise the spawned one: it has the caller's environment, standard
output and error before it imports the test function's module anew, and applies no adjustment before its test body
does (the server applies none); where the caller's environment differs from the server's in a variable the
libraries may read at import, the ranks are spawned. With CUDA they are spawned too: the server's imports may have
initialized the CUDA driver, which a forked process cannot use.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from multiprocessing.reduction import DupFd
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# what every rank imports anyway, in no order that matters: none of them reads what `lightning_megatron._compat`
# adjusts before its test body applies it (megatron-bridge and mbridge need adjustments to import: not here, but
# what megatron-bridge's import spends most of its time on is)
PRELOADED = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
             "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel", "transformers", "lightning.pytorch",
             "tests._forkserver_preload")
# variables the session sets after the server started, none of which the preloaded libraries read at import (a rank
# gets the caller's values of all of them before its test body runs): the ranks' rendezvous, pytest's test name,
# `lightning_megatron.data.cache`'s tokenizer workers, Megatron-Core's attention backend (set as a model is built),
# Lightning's seed (`seed_everything`, as the command line starts) and inductor's pointer (set as a kernel loads)
READ_AT_RUN_TIME = {"MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST", "TOKENIZERS_PARALLELISM", "NVTE_FLASH_ATTN",
                    "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "PL_GLOBAL_SEED", "PL_SEED_WORKERS",
                    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
_server_environment: dict[str, str] | None = None  # what the server started with (the first forked ranks' caller's)


def variables_changed_since_the_server_started() -> list[str]:
    """The variables, other than those read at run time, whose value is not the server's; none before it starts."""
    if _server_environment is None:
        return []
    return sorted(key for key in {*os.environ, *_server_environment} if key not in READ_AT_RUN_TIME
                  and os.environ.get(key) != _server_environment.get(key))


def start_method() -> str:
    """"forkserver" where the server imported its libraries in the caller's environment, else "spawn"."""
    global _server_environment
    if torch.cuda.is_available():
        return "spawn"
    if _server_environment is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
        # the server starts with the first forked rank, from this environment
        _server_environment = {key: value for key, value in os.environ.items() if key not in READ_AT_RUN_TIME}
    return "spawn" if variables_changed_since_the_server_started() else "forkserver"


class _CallerContext:
    """The caller's environment, standard output and error, put in place in a forked rank as it is unpickled: before
    the test function's module is imported, as a spawned rank has them from its start."""

    def __reduce__(self) -> tuple:  # DupFd: only while a process is being started
        return _enter_caller_context, (dict(os.environ), DupFd(1), DupFd(2))


def _enter_caller_context(environment: dict[str, str], *streams: Any) -> None:
    os.environ.clear()
    os.environ.update(environment)
    for fd, stream in zip((1, 2), streams, strict=True):
        received = stream.detach()
        os.dup2(received, fd)
        os.close(received)


def _worker(rank: int, caller_context: None, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
            out_dir: str) -> None:
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
    method = start_method()
    caller_context = _CallerContext() if method == "forkserver" else None  # unpickled first
    mp.start_processes(_worker, args=(caller_context, world_size, free_port(), fn, args, str(out_dir)),
                       nprocs=world_size, start_method=method, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def init_one_gpu_process() -> None:
    """In a process `run_in_fresh_process` started: NCCL and Megatron's parallel state as a one-GPU run sets them up
    (the suite's gloo group cannot carry the distributed optimizer's collectives on CUDA tensors)."""
    from lightning_megatron.distributed import free_port, init_single_process

    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()


def run_in_fresh_process(fn: Callable[..., None], tmp_path: Path, *args: str) -> Any:
    """Spawn one process running `fn(*args, out)` (a fresh CUDA context; `fn` sets up its own process group, as a
    single-GPU run does) and return what it saved to `out` with `torch.save`; a crash fails the test."""
    out = tmp_path / "results.pt"
    process = mp.get_context("spawn").Process(target=fn, args=(*args, str(out)))
    process.start()
    process.join()
    assert process.exitcode == 0, f"the spawned process exited with {process.exitcode}"
    return torch.load(out, weights_only=False)
