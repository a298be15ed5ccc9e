"""Megatron-Core on a machine without CUDA: the adjustments that let it run on CPU with gloo.

Megatron-Core 0.19 calls `torch.cuda.current_device()` ~200 times, writes `device="cuda"` ~70 times and
`.cuda()` ~20 times, and uses CUDA streams, events and RNG states. Patching each call site does not scale, so the
device adjustments work at the torch level; each is applied only when `torch.cuda.is_available()` is False.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_megatron._compat._adjustment import Adjustment, Patches


def no_cuda() -> bool:
    return not torch.cuda.is_available()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _install_current_device(patches: Patches) -> None:
    patches.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Creates on the CPU every tensor that upstream code asks for on "cuda" (factories, `.cuda()`, `.to("cuda")`).

    `tensor.type()` answers with the CUDA type name, because Megatron's optimizers accept only those.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # pinning needs a CUDA driver; a staging copy for .cuda() is pointless here
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _install_cuda_tensors_on_cpu(patches: Patches) -> None:
    mode = _CudaTensorsOnCpu()
    mode.__enter__()
    patches.on_revert(lambda: mode.__exit__(None, None, None))


class NoOpStream:
    """Stands for a CUDA stream or event on CPU, where every operation is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _no_op_stream_context(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _install_streams(patches: Patches) -> None:
    stream = NoOpStream()
    patches.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: stream)
    patches.setattr(torch.cuda, "Stream", NoOpStream)
    patches.setattr(torch.cuda, "Event", NoOpStream)
    patches.setattr(torch.cuda, "stream", _no_op_stream_context)
    patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)


def _install_rng_tracker(patches: Patches) -> None:
    from megatron.core.tensor_parallel import random

    class CpuRNGStatesTracker(random.CudaRNGStatesTracker):
        """Megatron's named RNG streams (model-parallel, data-parallel, expert) kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    patches.setattr(random, "CudaRNGStatesTracker", CpuRNGStatesTracker)


ADJUSTMENTS = (
    Adjustment(
        "cpu.current_device",
        "torch.cuda.current_device() in ~200 places, e.g. megatron/core/utils.py:715 (GlobalMemoryBuffer), "
        "transformer/multi_token_prediction.py:374 (MTP tracker buffers), param_and_grad_buffer.py:1186",
        no_cuda,
        _install_current_device,
    ),
    Adjustment(
        "cpu.cuda_tensors",
        'device="cuda" and .cuda(), e.g. transformer/utils.py:39 (default causal mask), '
        "pipeline_parallel/schedules.py:749, optimizer/optimizer.py:1249, models/common/language_module.py:307, "
        "models/common/embeddings/rope_utils.py:62 (pin_memory=True, CP rotary slice); "
        "tensor.type() == 'torch.cuda.FloatTensor' checks in optimizer/distrib_optimizer.py:466, optimizer/clip_grads.py:174",
        no_cuda,
        _install_cuda_tensors_on_cpu,
    ),
    Adjustment(
        "cpu.streams",
        "torch.cuda streams, events and synchronize, e.g. distributed/param_and_grad_buffer.py:632, "
        "pipeline_parallel/p2p_communication.py:419",
        no_cuda,
        _install_streams,
    ),
    Adjustment(
        "cpu.rng_tracker",
        "tensor_parallel/random.py:303 CudaRNGStatesTracker.add reads torch.cuda.get_rng_state()",
        no_cuda,
        _install_rng_tracker,
    ),
)
