"""Distributed helpers every room shares: the parallel sizes, agreeing on a failure, a one-process group.

A leaf: it imports nothing of `lightning_megatron` at import time (Megatron-Core only inside functions), so the
checkpoint writer, the bridges and the weight sync can use it without importing each other.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def parallel_sizes() -> dict[str, int | None]:
    """The current Megatron parallel state, under the names `TransformerConfig` uses."""
    from megatron.core import parallel_state

    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def agree_on_failure(error: BaseException | None, *, collective: bool = True,
                     error_type: type[Exception] = RuntimeError) -> None:
    """Raise on every rank when any rank failed: its own error where it failed, `error_type` elsewhere.

    For work that every rank does in lockstep (a save, a weight sync): no rank is left waiting for one that gave up.
    """
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=cpu_group())
        if failed.item():
            messages: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}",
                                   group=cpu_group())
            if error is None:
                rank, message = next((rank, text) for rank, text in enumerate(messages) if text is not None)
                raise error_type(f"rank {rank} failed: {message}")
    if error is not None:
        raise error


_CPU_GROUP: Any = None


def cpu_group() -> Any:
    """A gloo group over all ranks for the small host-side agreements of a save (the default group may be NCCL)."""
    global _CPU_GROUP
    if dist.get_backend() == "gloo":
        return None
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def init_single_process(seed: int = 1234) -> None:
    """One process: gloo (or NCCL with a GPU), Megatron parallel state TP=PP=1, seeded; what scripts and benchmarks
    outside a Trainer need."""
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def free_port() -> int:
    """A port nobody listens on now: a fixed one collides with any other run on the machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
