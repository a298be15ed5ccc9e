"""What "MTP" means, in one place: which parameters are MTP, what MTP training needs, and its per-step metrics."""

from __future__ import annotations

import math
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


def check_mtp_loss_scaling_factor(mtp_loss_scaling_factor: float) -> None:
    """The MTP loss's weight when the head trains: a finite positive number."""
    if not math.isfinite(mtp_loss_scaling_factor) or mtp_loss_scaling_factor <= 0:
        raise ValueError(f"mtp_loss_scaling_factor: {mtp_loss_scaling_factor} must be finite and > 0 "
                         "(DeepSeek-V3 uses 0.1)")


def check_mtp_training_options(mtp_loss_scaling_factor: float, checkpoint_mtp_layers: int) -> None:
    """What native MTP training needs, checked before any model is built."""
    check_mtp_loss_scaling_factor(mtp_loss_scaling_factor)
    if checkpoint_mtp_layers != 1:
        raise ValueError(f"MTP training supports exactly one MTP layer; the checkpoint declares "
                         f"{checkpoint_mtp_layers} (num_nextn_predict_layers / mtp_num_hidden_layers in config.json)")


def read_and_reset_mtp_tracker(num_microbatches: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Megatron-Core's process-global MTP tracker (summed over microbatches until cleaned), as per-step metrics.

    `mtp_loss`: mean over microbatches of each microbatch's masked MTP cross-entropy (unscaled), averaged over
    data-parallel ranks; `mtp_accuracy`: teacher-forced argmax accuracy of the MTP head.
    The tracker lives on the last pipeline stage; every stage returns the same values.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = torch.zeros(3, dtype=torch.float64, device=device)
    if "loss_values" in tracker:
        values[0] = tracker["loss_values"].sum().to(device, torch.float64)
        values[1] = tracker["correct_values"].sum().to(device, torch.float64)
        values[2] = tracker["total_values"].sum().to(device, torch.float64)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(values, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    # each CP rank logged its share of a microbatch's loss (the shares add up; `_compat.context_parallel`)
    loss = values[0] / (num_microbatches * parallel_state.get_data_parallel_world_size())
    return {"mtp_loss": loss.float(), "mtp_accuracy": (values[1] / values[2].clamp(min=1)).float()}
