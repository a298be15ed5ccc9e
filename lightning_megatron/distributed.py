"""Distributed helpers every room shares: the parallel sizes as one object, agreeing on a failure, a one-process
group, an exit that no gloo worker thread can abort.

A leaf: it imports nothing of `lightning_megatron` at import time (Megatron-Core only inside functions), so the
checkpoint writer, the bridges and the weight sync can use it without importing each other.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelSizes:
    """The sizes of Megatron's parallel groups, read together: tensor, pipeline, virtual pipeline, context, expert,
    expert-tensor and data parallel (data without context parallelism, as Megatron counts it)."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = 1
    data: int = 1

    @classmethod
    def current(cls) -> ParallelSizes:
        """The sizes of Megatron's current parallel state (`initialize_model_parallel` must have run)."""
        from megatron.core import parallel_state

        return cls(
            tensor=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline=parallel_state.get_pipeline_model_parallel_world_size(),
            virtual_pipeline=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            context=parallel_state.get_context_parallel_world_size(),
            expert=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor=parallel_state.get_expert_tensor_parallel_world_size(),
            data=parallel_state.get_data_parallel_world_size(),
        )

    @classmethod
    def for_world(cls, world_size: int, *, tensor: int, pipeline: int, virtual_pipeline: int | None, context: int,
                  expert: int, expert_tensor: int) -> ParallelSizes:
        """The sizes asked for on `world_size` processes, the data-parallel size derived; raises when the world is
        not a multiple of tensor x pipeline x context parallel sizes."""
        model_parallel = tensor * pipeline * context
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not a multiple of tensor x pipeline x context parallel sizes "
                f"(tensor_model_parallel_size {tensor} x pipeline_model_parallel_size {pipeline} x "
                f"context_parallel_size {context}); change devices/num_nodes or the parallel sizes"
            )
        return cls(tensor=tensor, pipeline=pipeline, virtual_pipeline=virtual_pipeline, context=context,
                   expert=expert, expert_tensor=expert_tensor, data=world_size // model_parallel)

    def initialize(self, *, timeout_minutes: int) -> None:
        """Make Megatron's parallel state these sizes (the process group must exist).

        Megatron never frees a process group it made: a second fit in the same process (a notebook, a test)
        keeps the parallel state when the sizes are the same rather than leaking another set of groups.
        """
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized() and ParallelSizes.current() == self:
            return
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(**self.config_fields(), distributed_timeout_minutes=timeout_minutes)

    def config_fields(self) -> dict[str, int | None]:
        """The model-parallel sizes under the names `TransformerConfig` (and `initialize_model_parallel`) use."""
        return {
            "tensor_model_parallel_size": self.tensor,
            "pipeline_model_parallel_size": self.pipeline,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline,
            "context_parallel_size": self.context,
            "expert_model_parallel_size": self.expert,
            "expert_tensor_parallel_size": self.expert_tensor,
        }

    def saved_fields(self) -> dict[str, int | None]:
        """`config_fields` plus `data_parallel_size`: the sizes a training checkpoint records (keys and order are
        part of its on-disk format)."""
        return {**self.config_fields(), "data_parallel_size": self.data}


def all_reduced(tensor: torch.Tensor, *, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    """A reduced copy of `tensor` over `group`: `reduce_op` "mean"/"avg" (None too; an integer tensor stays
    integer, as in Lightning's DDP), "sum", "max", "min", or a `torch.distributed.ReduceOp`."""
    name = "mean" if reduce_op is None else reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg")
    op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, name.upper()) if name else reduce_op
    result = tensor.clone()
    dist.all_reduce(result, op=op, group=group)
    if mean:
        result.copy_(result / dist.get_world_size(group))
    return result


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


def leader_value(value: Any) -> Any:
    """Global rank 0's `value` on every rank (a decision only the leader can make, e.g. from the engine's reply)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    container = [value]
    dist.broadcast_object_list(container, src=0, group=cpu_group())
    return container[0]


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
    outside a Trainer need. Calling it again keeps the groups and seeds again. A process group made here is
    destroyed when Python exits (NCCL otherwise warns of a leak at exit, which the script's user cannot act on)."""
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
        atexit.register(_destroy_the_default_group)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _destroy_the_default_group() -> None:
    if dist.is_initialized():  # unless the script destroyed it itself
        dist.destroy_process_group()


def megatron_rng_states() -> dict[str, torch.Tensor]:
    """Megatron-Core's named model-parallel RNG streams, copied as state tensors. Its graph-safe tracker (seeded when
    a CUDA graph may capture the training step, `cuda_graphs/`) holds generators that its forks advance in place:
    a reference to them would not keep the state, and a weights-only load would not read them."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import convert_cuda_rng_state

    return {name: convert_cuda_rng_state(state, to_graphable=False)
            for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()}


def set_megatron_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Put `megatron_rng_states()` back, whichever tracker (plain or graph-safe) took them or takes them now."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import convert_cuda_rng_state, is_graph_safe_cuda_rng_tracker

    tracker = tensor_parallel.get_cuda_rng_tracker()
    graph_safe = is_graph_safe_cuda_rng_tracker(tracker)
    tracker.set_states({name: convert_cuda_rng_state(state, to_graphable=graph_safe) for name, state in states.items()})


def free_port() -> int:
    """A port nobody listens on now: a fixed one collides with any other run on the machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exit_before_finalization(status: int) -> None:
    """When Python exits, run its exit handlers (`atexit`: logging, `multiprocessing`'s children, the user's) as
    always, then end the process with `status` (1 where an uncaught exception ended the program) before the
    interpreter finalizes. For a process that is to end: one that goes on after it still ends with `status`.

    Why not finalize: torch's gloo worker threads (`ProcessGroupGloo::runLoop`) destroy each collective's work after
    the caller's wait returned, and releasing a tensor that has a Python object takes the GIL
    (`TensorImpl::decref_pyobject`). A worker that asked for the GIL before the interpreter began finalizing and still
    waits for it then is ended by CPython (`PyThread_exit_thread` in `take_gil`), which unwinds through that noexcept
    destructor into `std::terminate`: the process dies of SIGABRT ("terminate called without an active exception")
    instead of exiting with `status` (pytorch/pytorch#190489). It takes the worker being descheduled at the wrong
    moment, for the few milliseconds the main thread needs from its last collective to the finalization: rare, but
    on a busy machine it happens. Nothing in a process that ends now needs finalizing.
    """
    running = False

    def exit_now() -> None:
        nonlocal running
        if running:
            return  # called again by `_run_exitfuncs` below
        running = True
        atexit._run_exitfuncs()  # every other handler, once, in Python's order; then none is left
        failed = getattr(sys, "last_exc", None) is not None  # set by an uncaught exception's traceback
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a stream may be closed, or replaced by one without flush
                stream.flush()
        os._exit(1 if failed else status)

    # registered as Python begins to exit, when all other code has run: the handler registered last runs first
    threading._register_atexit(lambda: atexit.register(exit_now))
