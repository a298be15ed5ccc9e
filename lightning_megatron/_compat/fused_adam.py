"""Megatron-Core's torch Adam without Transformer Engine or Apex, stepped by torch's fused kernel.

Without TE or Apex, megatron-core builds torch's own Adam for every Adam parameter group
(megatron/core/optimizer/__init__.py:25-35 falls back to `torch.optim.AdamW`; :545-586 builds
`adam_cls(**kwargs)`, `torch.optim.AdamW` or `Adam`, with neither `fused` nor `foreach`), and torch's step then takes
its foreach implementation on CUDA (torch/optim/adam.py:937-941: `_default_to_fused_or_foreach(..., use_fused=False)`).
That step makes temporaries the size of the whole group (`torch._foreach_sqrt(exp_avg_sqs)`, adam.py:790: one fp32
tensor per parameter, 4 bytes per parameter of the rank's shard, ~16 GB at 4B parameters): Qwen3-4B full SFT on an
80 GB H100 (bf16, distributed optimizer, 67.4 GiB of static memory) ran its forward and backward, then went out of
memory inside that step (issue 41). It also runs several kernels per list of tensors, one per elementwise operation.
torch's `fused=True` Adam (adam.py:802-899, `torch._fused_adamw_`) is one multi-tensor kernel that updates the
parameters and both moments in place with no temporary, as TE's and Apex's FusedAdam, which Megatron-Core picks where
installed, are.

How: `_get_megatron_optimizer_based_on_param_groups` (__init__.py:450), which `get_megatron_optimizer` (:1103, 1165,
1204) and the Adam groups of the emerging optimizers (:923, 950) call by its module name, is wrapped: what upstream
built, before any step, has the torch Adam it wraps (`MegatronOptimizer.optimizer`: the distributed optimizer's fp32
shards, the fp16/bf16 optimizer's fp32 copies, the fp32 optimizer's parameters) switched to `fused=True,
foreach=False`, in its defaults and every param group: torch reads both flags from the group at every step
(adam.py:263, 266). Nothing else of upstream's code or of the optimizer changes; where the condition below fails,
upstream's optimizer is returned as it is. The raw optimizers the layer-wise distributed optimizer takes
(`skip_megatron_wrapping`, :631-632) are left alone, and so is the optimizer CPU offload's `HybridDeviceOptimizer`,
which is no torch Adam and builds its own torch AdamWs fused already (`fused=True`, :524, copied into their groups).

Where it switches: a torch `Adam`/`AdamW` whose groups are not fused already nor `differentiable` (which fused
refuses, adam.py:104-106), all of whose parameters are plain floating tensors on CUDA (`FUSED_DEVICE_TYPES`; the
kernel's own requirement, torch/optim/optimizer.py:198-208). torch has a CPU fused Adam as well, but the CPU keeps
upstream's single-tensor Adam, the suite's numerical reference (a GPU machine's CPU fits too). `capturable`
(Megatron-Core's `optimizer_cuda_graph`, which the strategy never sets) is kept as built: torch's fused step ignores
it but for keeping `step` on the device, which fused does anyway (adam.py:168-176).

The step count: fused reads each parameter's `state["step"]` as a float32 tensor on the parameter's device, where
the foreach path keeps it as a CPU tensor (adam.py:168-176). A state made by the first step is made that way (the
switch comes before it). The states a checkpoint load makes (Megatron-Core's `init_state_fn` and its load, which
give `step` back from the checkpoint as a CPU tensor: megatron/core/optimizer/distrib_optimizer.py:1024-1032,
optimizer.py:550-553) are put right by a load post hook: torch's `load_state_dict` copies the saved param groups'
flags over the live ones (torch/optim/optimizer.py:1030-1042), so after every load the groups are switched again and
every `step` becomes a float32 copy of its own on its parameter's device. A state dict post hook writes the flags
upstream built the optimizer with into every param group it returns, so a checkpoint does not depend on the Adam
that ran: one saved before this adjustment (foreach) loads and steps fused, one saved fused loads where fused is off
(the CPU, `LIGHTNING_MEGATRON_FUSED_ADAM=0`, TE) into upstream's Adam as upstream's own would. The flags are `None`
or booleans, which `safe_load` admits; the step counts a checkpoint holds do not depend on the device (the
distributed optimizer saves a number, distrib_optimizer.py:836-871; the others a tensor that loads onto the CPU).

An optimizer built while the adjustment was applied stays fused after a revert; only what is built later is
upstream's again. `implementations` says which Adam a Megatron-Core optimizer steps with (the benchmarks record it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from lightning_megatron._compat import compiled
from lightning_megatron._compat._adjustment import Adjustment, Patches

FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""The devices whose parameters the adjustment gives torch's fused Adam (the CPU keeps upstream's, see above)."""

IMPLEMENTATION_FLAGS = ("fused", "foreach")
"""The param-group keys that choose torch's Adam implementation (adam.py:263, 266)."""

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def fused_can_run(optimizer: torch.optim.Optimizer, device_types: Sequence[str] = FUSED_DEVICE_TYPES) -> bool:
    """Whether `optimizer` is a torch Adam(W) not fused yet that torch's fused kernel can step on `device_types`."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        return False
    groups = optimizer.param_groups
    params = [param for group in groups for param in group["params"]]
    return (bool(params) and not any(group["fused"] or group["differentiable"] for group in groups)
            and all(type(param) in _PLAIN_TENSORS and param.device.type in device_types
                    and torch.is_floating_point(param) for param in params))


def switch_to_fused(optimizer: torch.optim.Optimizer, device_types: Sequence[str] = FUSED_DEVICE_TYPES) -> bool:
    """`optimizer` stepped by torch's fused Adam from now on, after checkpoint loads too, its state dicts keeping
    the flags it was built with; where `fused_can_run`. Returns whether it switched."""
    if not fused_can_run(optimizer, device_types):
        return False
    built_with = {key: optimizer.defaults[key] for key in IMPLEMENTATION_FLAGS}
    _make_fused(optimizer)
    optimizer.register_state_dict_post_hook(functools.partial(_with_flags, built_with))
    optimizer.register_load_state_dict_post_hook(_make_fused)
    return True


def _make_fused(optimizer: torch.optim.Optimizer) -> None:
    """The defaults (which `add_param_group` copies) and every group fused; every `step` a float32 tensor of its
    own on its parameter's device, as fused reads it (torch's load casts it so only for groups saved fused,
    torch/optim/optimizer.py:813-817)."""
    for target in (optimizer.defaults, *optimizer.param_groups):
        target.update(fused=True, foreach=False)
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32, copy=True)


def _with_flags(flags: dict[str, Any], optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """A state dict post hook: the saved param groups (copies of the live ones, torch/optim/optimizer.py:760-775)
    with `flags`; the state is the live one, left alone."""
    for group in state_dict["param_groups"]:
        group.update(flags)


def implementations(megatron_optimizer: Any) -> list[str]:
    """Which implementation each torch Adam inside a Megatron-Core optimizer steps with: "fused", "foreach" or
    "for-loop" (torch's choice where neither flag is set: foreach when every parameter is on CUDA,
    torch/optim/optimizer.py:170-195), by its parts' order; an optimizer of another kind gives its class name."""
    from megatron.core.optimizer import ChainedOptimizer

    parts = megatron_optimizer.chained_optimizers if isinstance(megatron_optimizer, ChainedOptimizer) else [
        megatron_optimizer]
    return [_implementation(part.optimizer) for part in parts]


def _implementation(optimizer: Any) -> str:
    if not isinstance(optimizer, torch.optim.Adam):
        return type(optimizer).__name__
    kinds = set()
    for group in optimizer.param_groups:
        if group["fused"]:
            kinds.add("fused")
        elif group["foreach"] or (group["foreach"] is None and all(param.is_cuda for param in group["params"])):
            kinds.add("foreach")
        else:
            kinds.add("for-loop")
    return "+".join(sorted(kinds))


# the adjustment ---------------------------------------------------------------------------------------------------


OPT_IN = "LIGHTNING_MEGATRON_FUSED_ADAM"
"""On by default (unset or 1); 0 keeps the torch Adam Megatron-Core builds (foreach on CUDA)."""


def opted_in() -> bool:
    """`LIGHTNING_MEGATRON_FUSED_ADAM`: unset or 1 applies the adjustment (where its condition holds), 0 leaves
    Megatron-Core's torch Adam as it builds it, anything else is refused (`compiled.switched_on`)."""
    return compiled.switched_on(OPT_IN, "torch's foreach Adam, as Megatron-Core builds it",
                                "torch's fused Adam on a GPU without Transformer Engine or Apex")


def upstream_builds_torch_adam_unfused() -> bool:
    """Whether megatron-core falls back to torch's Adam (no TE, no Apex) and still builds it without `fused`."""
    from megatron.core import optimizer

    source = inspect.getsource(optimizer._get_megatron_optimizer_based_on_param_groups)
    return optimizer.USING_PYTORCH_OPTIMIZER and "optimizer = adam_cls(**kwargs)" in source and '"fused"' not in source


def _fused_adam_is_needed_here() -> bool:
    return opted_in() and torch.cuda.is_available() and upstream_builds_torch_adam_unfused()


def _install_fused_adam(patches: Patches) -> None:
    from megatron.core import optimizer as optimizers
    from megatron.core.optimizer import MegatronOptimizer

    upstream = optimizers._get_megatron_optimizer_based_on_param_groups

    @functools.wraps(upstream)
    def build(*args: Any, **kwargs: Any) -> Any:
        """Upstream's optimizer, its torch Adam switched to fused (`switch_to_fused`) where it can run."""
        built = upstream(*args, **kwargs)
        if isinstance(built, MegatronOptimizer) and isinstance(built.optimizer, torch.optim.Optimizer):
            switch_to_fused(built.optimizer, FUSED_DEVICE_TYPES)
        return built

    patches.setattr(optimizers, "_get_megatron_optimizer_based_on_param_groups", build)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.fused_adam",
        "megatron/core/optimizer/__init__.py:545-586 builds torch.optim.AdamW without `fused` (no TE/Apex), whose "
        "foreach step (torch/optim/adam.py:790) allocates an fp32 temporary the size of the rank's parameters and "
        "runs several kernels per tensor list",
        _fused_adam_is_needed_here,
        _install_fused_adam,
    ),
)
