"""`VLSFTModule`: image + text supervised fine-tuning of a Qwen-VL checkpoint built by megatron-bridge.

The microbatches come from `VLSFTDataModule`: token rows (padded, or packed THD with `cu_seqlens`) plus the images
of their sequences (`pixel_values`, `image_grid_thw`). The model embeds the images, puts them in place of the
image tokens, computes the MRoPE positions from the token ids and image grids, and returns the per-token loss.

Context parallelism (Qwen3-VL only): each rank gets the full row, because the image embeddings must be fused into
the whole sequence first; the model then keeps this rank's part of every packed sequence (Megatron's load-balanced
chunks) for the decoder, labels included. The loss mask is cut the same way here, with the data pipeline's
`split_for_context_parallel`, so the response mask stays aligned with each packed sequence's CP partition.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.microbatch import LossOutput, Microbatch, model_inputs, split_for_context_parallel
from lightning_megatron.module import SFTModule, masked_token_loss
from lightning_megatron.options import ModelOptions


class VLSFTModule(SFTModule):
    """`SFTModule` for Qwen2.5-VL and Qwen3-VL: the same optimizer, schedule and logged `lm_loss`, with images.

    MTP heads and generation (`predict`) are text-model features and are refused here. The optimizer options are
    `SFTModule`'s.

    Args:
        freeze_vision_tower: keep the vision encoder's weights fixed (the projection into the language model still
            trains).
    """

    # The strategy hands over full rows; the model cuts them after fusing the images (see the module docstring).
    cuts_context_parallel_in_model = True
    # Megatron-Bridge's Qwen-VL models read the image grids on the host (vision windows, MRoPE positions): a replay
    # would repeat the captured batch's
    replayable_training_step = False

    def __init__(
        self,
        freeze_vision_tower: bool = False,
        lr: float = 1e-5,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.95,
        adam_eps: float = 1e-8,
    ) -> None:
        super().__init__(lr=lr, min_lr_ratio=min_lr_ratio, warmup_steps=warmup_steps, weight_decay=weight_decay,
                         adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps)
        self.freeze_vision_tower = freeze_vision_tower

    def model_options(self) -> ModelOptions:
        overrides: dict[str, Any] = {"freeze_vision_model": True} if self.freeze_vision_tower else {}
        return ModelOptions(config_overrides=overrides)

    def setup(self, stage: str) -> None:
        if stage == "predict":
            raise ValueError("VLSFTModule trains and evaluates; predict (generation) is supported for text models "
                             "only (SFTModule)")
        super().setup(stage)

    def forward_step(self, model: torch.nn.Module, microbatch: Microbatch) -> torch.Tensor:
        # MRoPE positions come from the token ids and the image grids
        inputs: dict[str, Any] = {**model_inputs(microbatch), "position_ids": None}
        if "pixel_values" in microbatch:
            dtype = next(model.parameters()).dtype
            inputs["pixel_values"] = microbatch["pixel_values"].to(dtype)
            inputs["image_grid_thw"] = microbatch["image_grid_thw"]
        output = model(**inputs)
        # Qwen3-VL with CP returns (per-token loss, its CP-cut loss mask); loss_func cuts the mask identically.
        return output[0] if isinstance(output, tuple) else output

    def loss_func(self, microbatch: Microbatch, output: torch.Tensor) -> LossOutput:
        return masked_token_loss(context_parallel_part(microbatch), output)


def context_parallel_part(microbatch: Microbatch) -> Microbatch:
    """The part of a full-row microbatch this context-parallel rank's model output covers (itself when CP=1)."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return microbatch
    tokens = {key: microbatch[key] for key in ("input_ids", "loss_mask", "cu_seqlens") if key in microbatch}
    return split_for_context_parallel(tokens, parallel_state.get_context_parallel_rank(), cp_size)
