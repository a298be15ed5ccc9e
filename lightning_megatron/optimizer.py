"""Megatron's optimizer as a `torch.optim.Optimizer`, so Lightning and torch LR schedulers drive it unchanged.

Megatron-Core's optimizers (mixed precision, distributed, chained) are not `torch.optim.Optimizer` subclasses, and
torch's LR schedulers refuse anything else. This adapter exposes Megatron's parameter groups (the same dicts, so a
scheduler's writes reach the real groups) and runs Megatron's step, which unscales, clips and reports the grad norm.

Optimizer CPU offload (`MegatronStrategy(optimizer_offload_fraction=...)`): Megatron-Core's `HybridDeviceOptimizer`
(megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py) keeps that fraction of the parameters' fp32 master
weights and Adam states in host memory and steps them with torch's CPU AdamW, the rest with torch's AdamW on the
GPU; neither needs Transformer Engine or Apex (megatron/core/optimizer/__init__.py:502-541 picks torch's optimizers
without them). It runs through the precision-aware distributed optimizer, so the master weights live only inside
the hybrid optimizer, never as a second copy on the GPU (optimizer_config.py:404-411, distrib_optimizer.py:421-455):
a bf16 model on one GPU then holds 2 (weights) + 4 (fp32 main grads) + 12 x (1 - fraction) bytes per parameter
instead of 18, and the host 16 x fraction (fp32 master, grads, Adam's two moments). It needs a CUDA device (CUDA
streams, pinned memory), bf16 parameters, the distributed optimizer and decoupled weight decay (AdamW:
`__init__.py:508-510`);
`optimizer_config.py:430-446` asks for Transformer Engine's FusedAdam only when nothing is offloaded. Its param
groups hold the optimizer classes it steps with, which checkpoints leave out (`without_optimizer_classes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch


class MegatronOptimizerAdapter(torch.optim.Optimizer):
    """Wraps a Megatron-Core `MegatronOptimizer`; `step` returns the closure's loss, `last_grad_norm*` the norms."""

    def __init__(self, megatron_optimizer: Any) -> None:
        # torch's __init__ would build param groups of its own; Megatron's are the ones to use.
        self.megatron_optimizer = megatron_optimizer
        self.defaults: dict[str, Any] = {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        self.last_grad_norm: float | None = None
        self.last_grad_norms_by_group: dict[str, float] = {}
        self.last_update_successful: bool | None = None
        self._gradients_cleared = False  # set to None by `zero_grad`, and none set since: `step` sets them

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.megatron_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.megatron_optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.megatron_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.megatron_optimizer.state = value

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """What the last step reports: `grad_norm`, `grad_norm_<group>` per group Megatron clips apart, `lr`.

        Host tensors of the dtype Lightning gives logged numbers: Lightning would make each Python number a tensor
        on the module's device, a copy from pageable memory that makes the host wait for a CUDA device."""
        metrics = {} if self.last_grad_norm is None else {"grad_norm": self.last_grad_norm}
        metrics.update({f"grad_norm_{group}": norm for group, norm in self.last_grad_norms_by_group.items()})
        if self.param_groups:
            metrics["lr"] = self.param_groups[0]["lr"]
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {name: torch.tensor(value, dtype=dtype) for name, value in metrics.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Megatron's `zero_grad`, skipped when the last one set the gradients to None and nothing set one since.

        Why: each training step clears the gradients twice, before its forward-backward (`forward_backward`, as
        Megatron-LM's `train_step` does) and again in Lightning's closure (`optimizer_zero_grad`, after the training
        step); Megatron's `zero_grad` walks every parameter of every group in Python, and on a host-bound step
        (issue 41) the second walk is pure cost. Nothing sets one in between: the schedule's backward accumulates
        into Megatron DDP's buffers and leaves `param.grad` None (megatron/core/distributed/
        distributed_data_parallel.py:494), and only `step` copies the buffers into the gradients it steps with.
        """
        if self._gradients_cleared:
            return
        self.megatron_optimizer.zero_grad(set_to_none)
        self._gradients_cleared = set_to_none  # zeroed in place, a later call may still free them

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self._gradients_cleared = False
        update_successful, grad_norm, _ = self.megatron_optimizer.step()
        self.last_update_successful = bool(update_successful)
        self.last_grad_norm = None if grad_norm is None else float(grad_norm)
        # Megatron norms and clips some parameters apart from the rest (the MTP head with detached heads: "mtp")
        groups = getattr(self.megatron_optimizer, "grad_norms_by_group", None) or {}
        self.last_grad_norms_by_group = {name: float(norm) for name, norm in groups.items()}
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self.megatron_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict, also one `sharded_state_dict` wrote: the optimizer classes it leaves out are this
        optimizer's own (`with_optimizer_classes`)."""
        self.megatron_optimizer.load_state_dict(with_optimizer_classes(self.megatron_optimizer, state_dict))

    def sharded_state_dict(self, model_sharded_state_dict: dict, *, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        """Megatron's sharded state dict, less the optimizer classes in its param groups
        (`without_optimizer_classes`), so that a checkpoint holds only what `safe_load` admits."""
        sharded = self.megatron_optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                                             metadata=metadata)
        return without_optimizer_classes(self.megatron_optimizer, sharded)

    def __repr__(self) -> str:
        return f"MegatronOptimizerAdapter({type(self.megatron_optimizer).__name__})"


def without_optimizer_classes(megatron_optimizer: Any, state: Any) -> Any:
    """`state` (Megatron's state dict or sharded state dict of `megatron_optimizer`), its param groups without the
    classes the optimizer's torch optimizer holds among its defaults; changed in place, and returned.

    The offload's `HybridDeviceOptimizer` records the classes it steps with (`cpu_optimizer_cls`,
    `gpu_optimizer_cls`: torch's AdamW, or Transformer Engine's FusedAdam) among its defaults
    (hybrid_optimizer.py:57-69), torch copies every default into every param group (`add_param_group`), and the
    distributed optimizer saves the param groups in the checkpoint's common state (distrib_optimizer.py:866,
    1532). A class in a pickle is a global `safe_load` refuses: admitting it would also let any file call it
    (torch's weights-only unpickler calls the globals it admits), so the classes are kept out of the checkpoint
    instead, and `with_optimizer_classes` takes them from the live optimizer when it loads, which was built with
    the same ones.
    """
    for groups, classes in _param_groups_and_classes(megatron_optimizer, state):
        for group in groups:
            for key in classes:
                group.pop(key, None)
    return state


def with_optimizer_classes(megatron_optimizer: Any, state: Any) -> Any:
    """`state` with the classes `without_optimizer_classes` left out, from `megatron_optimizer`'s own defaults, so
    that the param groups it loads equal those it saved; changed in place, and returned."""
    for groups, classes in _param_groups_and_classes(megatron_optimizer, state):
        for group in groups:
            group.update(classes)
    return state


def _param_groups_and_classes(megatron_optimizer: Any, state: Any) -> list[tuple[list[dict], dict[str, type]]]:
    """For each Megatron optimizer in `megatron_optimizer` (itself, or a `ChainedOptimizer`'s, whose state is a
    list or a dict by index): the param groups its part of `state` holds, and the class-valued defaults of its
    torch optimizer; only the optimizers that have such defaults."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.optimizer import ChainedOptimizer

    chained = isinstance(megatron_optimizer, ChainedOptimizer)
    optimizers = megatron_optimizer.chained_optimizers if chained else [megatron_optimizer]
    if len(optimizers) == 1:
        parts = [state]
    else:
        parts = [part for _, part in sorted(state.items())] if isinstance(state, dict) else list(state)
    found = []
    for optimizer, part in zip(optimizers, parts, strict=True):
        inner = optimizer.optimizer  # every MegatronOptimizer wraps a torch optimizer (or None)
        defaults = inner.defaults if isinstance(inner, torch.optim.Optimizer) else {}
        classes = {key: value for key, value in defaults.items() if isinstance(value, type)}
        common = part.get("optimizer") if classes else None
        if isinstance(common, ShardedObject):  # a format that is not fully reshardable wraps it
            common = common.data
        if common is not None:
            found.append((common["param_groups"], classes))
    return found


def megatron_optimizer(config: Any, chunks: list[torch.nn.Module], *, bf16: bool, use_distributed_optimizer: bool,
                       clip_grad: float, offload_fraction: float = 0.0) -> MegatronOptimizerAdapter:
    """Megatron's optimizer for the wrapped `chunks`: the hyperparameters of `config` (an `OptimizerConfig`), the
    precision, distribution, clipping and CPU offload given; the model's loss scaling follows it."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config

    config = dataclasses.replace(config, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                                 use_distributed_optimizer=use_distributed_optimizer, clip_grad=clip_grad)
    if offload_fraction > 0:
        config = offloaded(config, offload_fraction)
    optimizer = get_megatron_optimizer(config, chunks)
    get_model_config(chunks[0]).grad_scale_func = optimizer.scale_loss
    return MegatronOptimizerAdapter(optimizer)


def check_optimizer_offload(fraction: float, *, use_distributed_optimizer: bool, precision: str) -> None:
    """`MegatronStrategy(optimizer_offload_fraction=...)`, checked when the strategy is made."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"optimizer_offload_fraction: {fraction!r} must be a number from 0 (the optimizer on the GPU) "
                         "to 1 (all its fp32 master weights and Adam states in host memory)")
    if fraction > 0 and not use_distributed_optimizer:
        raise ValueError(f"optimizer_offload_fraction: {fraction} needs use_distributed_optimizer: true (Megatron-Core "
                         "offloads through its precision-aware distributed optimizer); set use_distributed_optimizer: "
                         "true or optimizer_offload_fraction: 0")
    if fraction > 0 and precision != "bf16":
        # distrib_optimizer.py:466-469 hands fp32 parameters to the hybrid optimizer as views that are not leaves,
        # which torch's optimizers refuse ("can't optimize a non-leaf Tensor")
        raise ValueError(f"optimizer_offload_fraction: {fraction} needs precision: bf16 (Megatron-Core's offload takes "
                         f"bf16 parameters with fp32 master weights), got {precision}; set precision: bf16 or "
                         "optimizer_offload_fraction: 0")


def check_optimizer_offload_device(fraction: float, device: torch.device) -> None:
    """The offload copies between CUDA streams and pinned host memory: refused, before any model is built, elsewhere."""
    if fraction > 0 and device.type != "cuda":
        raise ValueError(f"optimizer_offload_fraction: {fraction} needs a CUDA device (Megatron-Core's "
                         f"HybridDeviceOptimizer copies through CUDA streams and pinned memory), got {device.type}; "
                         "set optimizer_offload_fraction: 0 (or train on a GPU)")


def offloaded(config: Any, fraction: float) -> Any:
    """`config` (an `OptimizerConfig`) with `fraction` of the optimizer in host memory: Megatron-Core's CPU offload
    through the precision-aware distributed optimizer (see the module docstring)."""
    if config.optimizer != "adam" or not config.decoupled_weight_decay:
        raise ValueError(f"optimizer_offload_fraction: Megatron-Core offloads Adam with decoupled weight decay only "
                         f"(OptimizerConfig(optimizer='adam', decoupled_weight_decay=True)), got optimizer="
                         f"{config.optimizer!r}, decoupled_weight_decay={config.decoupled_weight_decay}; set "
                         "optimizer_offload_fraction: 0 or use that optimizer")
    return dataclasses.replace(config, optimizer_cpu_offload=True, optimizer_offload_fraction=float(fraction),
                               use_precision_aware_optimizer=True)


def check_megatron_optimizers(optimizers: Sequence[object]) -> None:
    """Raise unless every optimizer is the one `megatron_optimizer` made (it owns the DDP gradient buffers)."""
    if not all(isinstance(optimizer, MegatronOptimizerAdapter) for optimizer in optimizers):
        raise TypeError("configure_optimizers must return the optimizer from "
                        "trainer.strategy.megatron_optimizer(OptimizerConfig(...)) (Megatron's optimizer "
                        "owns the DDP gradient buffers); do not configure it through LightningCLI's "
                        "optimizer: group")
