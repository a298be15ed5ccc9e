"""What "MTP" means, in one place: which parameters are MTP, what MTP training needs, and its per-step metrics."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from importlib import metadata

import torch
from packaging.version import Version

MTP_TRAINING_MINIMUM_VERSIONS = {"megatron-core": "0.19.0", "megatron-bridge": "0.6.0"}


def is_mtp_parameter(name: str) -> bool:
    """A parameter is MTP when a module on its path (not the parameter itself) is named `mtp`."""
    return "mtp" in name.split(".")[:-1]


def check_mtp_training_versions(installed: dict[str, str | None] | None = None) -> None:
    """Raise unless megatron-core and megatron-bridge are new enough for native MTP training.

    Pre-releases of a minimum (`0.19.0rc1`) are rejected; local builds of it (`0.19.0+vendor.1`) pass.
    """
    for package, minimum in MTP_TRAINING_MINIMUM_VERSIONS.items():
        version = installed[package] if installed is not None else _installed_version(package)
        if version is None:
            raise RuntimeError(f"MTP training needs {package}>={minimum}, which is not installed")
        if Version(version) < Version(minimum):
            raise RuntimeError(f"MTP training needs {package}>={minimum}; found {package}=={version}")


def _installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def mtp_parameter_flags(chunks: list[torch.nn.Module]) -> dict[int, tuple[str, torch.nn.Parameter, bool]]:
    """id -> (name, parameter, is_mtp) over every chunk; a parameter reachable under several names (a tied embedding
    or output projection shared with the MTP layer) is MTP only if every one of its names is."""
    flags: dict[int, tuple[str, torch.nn.Parameter, bool]] = {}
    for index, chunk in enumerate(chunks):
        for name, parameter in chunk.named_parameters(remove_duplicate=False):
            is_mtp = is_mtp_parameter(name)
            if id(parameter) in flags:
                first_name, _, was_mtp = flags[id(parameter)]
                flags[id(parameter)] = (first_name, parameter, was_mtp and is_mtp)
            else:
                flags[id(parameter)] = (f"{index}.{name}", parameter, is_mtp)
    return flags


def freeze_non_mtp_parameters(chunks: list[torch.nn.Module], *, allow_missing_mtp: bool) -> list[str]:
    """Freeze everything but the MTP layers; returns the trainable names. A pipeline stage without the MTP layer
    (`allow_missing_mtp`) freezes everything and still takes part in the schedule and the optimizer step."""
    flags = mtp_parameter_flags(chunks)
    trainable = [name for name, _, is_mtp in flags.values() if is_mtp]
    if not trainable and not allow_missing_mtp:
        raise ValueError("MTPOnlyCallback found no MTP parameters to train (no module named `mtp` in the model); "
                         "set SFTModule(enable_mtp=True) on a checkpoint with an MTP head")
    for _, parameter, is_mtp in flags.values():
        parameter.requires_grad_(is_mtp)
    return trainable


def is_finite_number(value: object) -> bool:
    """A finite real number, not a bool or a string: what the MTP options' numbers must be before any arithmetic
    (`math.isfinite` of a string raises its own error, which names no option)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_mtp_loss_scaling_factor(mtp_loss_scaling_factor: float) -> None:
    """The MTP loss's weight when the head trains: a finite positive number."""
    if not is_finite_number(mtp_loss_scaling_factor) or mtp_loss_scaling_factor <= 0:
        raise ValueError(f"mtp_loss_scaling_factor: {mtp_loss_scaling_factor!r} must be finite and > 0 "
                         "(DeepSeek-V3 uses 0.1)")


def check_mtp_training_options(mtp_loss_scaling_factor: float, checkpoint_mtp_layers: int) -> None:
    """What native MTP training needs, checked before any model is built."""
    check_mtp_loss_scaling_factor(mtp_loss_scaling_factor)
    if checkpoint_mtp_layers != 1:
        raise ValueError(f"MTP training supports exactly one MTP layer; the checkpoint declares "
                         f"{checkpoint_mtp_layers} (num_nextn_predict_layers / mtp_num_hidden_layers in config.json); "
                         "to train several drafting depths keep one layer and set SFTModule(mtp_depths=K), which "
                         "applies it K times")


def normalized_depth_weights(mtp_depths: int, weights: Sequence[float] | None) -> tuple[float, ...]:
    """The share of the MTP loss each drafting depth gets: `weights` (default uniform) normalised to sum to 1, so
    that `mtp_loss_scaling_factor` stays the MTP loss's overall weight."""
    if isinstance(mtp_depths, bool) or not isinstance(mtp_depths, int) or mtp_depths < 1:
        raise ValueError(f"mtp_depths: {mtp_depths!r} must be an integer >= 1 (the drafting depths the one MTP layer "
                         "is trained at; 1: its own depth only)")
    if weights is None:
        return (1.0 / mtp_depths,) * mtp_depths
    numbers = None
    if not isinstance(weights, str | bytes):  # a string's characters are not the depths' weights
        try:
            numbers = [float(weight) for weight in weights]
        except (TypeError, ValueError):
            pass
    if numbers is None:
        raise ValueError(f"mtp_depth_weights: {weights!r} must be a list of numbers, one per depth (mtp_depths: "
                         f"{mtp_depths}, e.g. {[float(mtp_depths - depth) for depth in range(mtp_depths)]}), or null "
                         "for equal weights")
    weights = numbers
    if len(weights) != mtp_depths:
        raise ValueError(f"mtp_depth_weights: {weights} has {len(weights)} entries; give one per depth "
                         f"(mtp_depths: {mtp_depths}), or leave it null for equal weights")
    if not all(math.isfinite(weight) and weight >= 0 for weight in weights) or sum(weights) <= 0:
        raise ValueError(f"mtp_depth_weights: {weights} must be finite, >= 0 and not all 0 (only their ratios "
                         "matter: mtp_loss_scaling_factor is the MTP loss's overall weight)")
    largest = max(weights)  # first, so that huge weights do not sum to infinity
    weights = [weight / largest for weight in weights]
    return tuple(weight / sum(weights) for weight in weights)


def clear_mtp_tracker() -> None:
    """Forget Megatron-Core's process-global MTP tracker: it is sized by the depth count of the first model that
    logs to it, and a later fit in the same process may train another number of depths."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def read_and_reset_mtp_tracker(num_microbatches: int, device: torch.device,
                               depth_weights: Sequence[float] | torch.Tensor = (1.0,)
                               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Megatron-Core's process-global MTP tracker (summed over microbatches until cleaned), as per-step metrics, and
    per depth whether it had no trained token in the whole step (over every rank; a bool tensor on `device`, read on
    the host only when needed: `UntrainedDepths`): rows or sequences too short for it, whose logged losses read 0
    (a microbatch without a token at a depth counts 0 in its mean, as Megatron-LM logs it). Nothing here waits for
    the device (`depth_weights` as a float64 tensor on `device` spares even the copy of the weights).

    `mtp_loss`: per depth, the mean over microbatches of each microbatch's masked MTP loss (unscaled), averaged over
    data-parallel ranks; then the mean over depths by `depth_weights` (`mtp_depth_weights`: the loss trained, before
    `mtp_loss_scaling_factor`). `mtp_accuracy`: teacher-forced argmax accuracy of the MTP head, over every depth's
    tokens. With several depths also `mtp_loss_depth_<k>` and `mtp_accuracy_depth_<k>`, k = 1.. .
    The tracker lives on the last pipeline stage; every stage returns the same values.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    depths = len(depth_weights)
    if "loss_values" in tracker:
        if tracker["loss_values"].numel() != depths:
            raise RuntimeError(f"Megatron-Core's MTP tracker holds {tracker['loss_values'].numel()} depth(s), the "
                               f"module trains {depths}; clear_mtp_tracker() before a fit with another mtp_depths")
        values = torch.stack([tracker[key].view(depths) for key in ("loss_values", "correct_values",
                                                                      "total_values")]).to(device, torch.float64)
    else:
        values = torch.zeros(3, depths, dtype=torch.float64, device=device)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(values, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    # each CP rank logged its share of a microbatch's loss (the shares add up; `_compat.context_parallel`)
    losses = values[0] / (num_microbatches * parallel_state.get_data_parallel_world_size())
    weights = depth_weights if isinstance(depth_weights, torch.Tensor) else torch.tensor(
        depth_weights, dtype=torch.float64, device=device)
    metrics = {"mtp_loss": (losses * weights).sum().float(),
               "mtp_accuracy": (values[1].sum() / values[2].sum().clamp(min=1)).float()}
    if depths > 1:
        for depth in range(depths):
            metrics[f"mtp_loss_depth_{depth + 1}"] = losses[depth].float()
            metrics[f"mtp_accuracy_depth_{depth + 1}"] = (values[1, depth] / values[2, depth].clamp(min=1)).float()
    return metrics, values[2] == 0


class UntrainedDepths:
    """The first step in which some MTP depth had no trained token, and those depths, kept on the device step by
    step (`record`) and read on the host only when asked (`first`): at a logging step, not every step."""

    def __init__(self) -> None:
        self._first_step: torch.Tensor | None = None  # per depth: the first step it was untrained in, -1: none yet

    def record(self, untrained: torch.Tensor, step: int) -> None:
        if self._first_step is None:
            self._first_step = torch.full_like(untrained, -1, dtype=torch.int64)
        self._first_step = torch.where(untrained & (self._first_step < 0), step, self._first_step)

    def first(self) -> tuple[int, list[int]] | None:
        """(the step, its untrained depths 1..) of the first step that had any; None when none had: one host read."""
        if self._first_step is None:
            return None
        first_steps = self._first_step.tolist()
        recorded = [step for step in first_steps if step >= 0]
        if not recorded:
            return None
        step = min(recorded)
        return step, [depth + 1 for depth, first in enumerate(first_steps) if first == step]
