"""The MTP draft head on the Hugging Face side, and loading a target model with its head from an HF checkpoint.

Megatron-Core 0.19's MTP layer (``MultiTokenPredictionLayer``) reads the main decoder's output *after* its final
norm: at position ``t`` it combines that hidden state ``h_t`` with the embedding of token ``t+1``, runs one decoder
layer at rotary position ``t`` and predicts token ``t+2`` through the shared output layer. :class:`MTPDraftHead`
computes exactly that with the target's own Hugging Face modules (the same decoder-layer and norm classes, the
shared embedding, rotary embedding and LM head), plus a KV cache of its own, so that it can draft one token per
decoding step without re-reading the prefix. ``lightning_megatron.testing.checkpoints.hf_mtp_reference_logits`` is the
independent, cache-free statement of the same computation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.masking_utils import create_causal_mask


@dataclass(frozen=True)
class MTPLayout:
    """Where one family keeps its (single) MTP layer in an HF checkpoint."""

    family: str
    embedding_norm: str
    hidden_norm: str
    projection: str
    hidden_first: bool  # the projection's input is cat([hidden, embedding]) rather than cat([embedding, hidden])
    layer_prefix: str  # the decoder layer's tensors, named as in the main decoder's layers
    final_norm: str


# Spelled out from megatron-bridge 0.6.2's qwen3_bridge.py and mimo_bridge.py mappings.
LAYOUTS = (
    MTPLayout(
        family="qwen3",
        embedding_norm="mtp.pre_fc_norm_embedding",
        hidden_norm="mtp.pre_fc_norm_hidden",
        projection="mtp.fc",
        hidden_first=False,
        layer_prefix="mtp.layers.0.",
        final_norm="mtp.norm",
    ),
    MTPLayout(
        family="mimo",
        embedding_norm="model.mtp_layers.0.token_layernorm",
        hidden_norm="model.mtp_layers.0.hidden_layernorm",
        projection="model.mtp_layers.0.input_proj",
        hidden_first=True,
        layer_prefix="model.mtp_layers.0.",
        final_norm="model.mtp_layers.0.final_layernorm",
    ),
)

MTP_PREFIXES = ("mtp.", "model.mtp_layers.")
"""Tensor-name prefixes of the MTP layers in :data:`LAYOUTS`: what the target model leaves unloaded."""


class MTPDraftHead(nn.Module):
    """One MTP layer that drafts token ``t+2`` from the target's final-normed hidden state at ``t`` and token ``t+1``.

    ``eh_proj`` takes ``cat([embedding, hidden])`` as in Megatron (MiMo's ``input_proj`` halves are swapped on load).
    The embedding, rotary embedding and LM head are the target's own modules, shared rather than copied, so a tied
    or later-trained LM head is always the one the target uses.
    """

    def __init__(self, target: PreTrainedModel, layout: MTPLayout) -> None:
        super().__init__()
        config = target.config
        self.layout = layout
        norm_class, layer_class = type(target.model.norm), type(target.model.layers[0])
        self.config = config
        self.enorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = layer_class(config, layer_idx=0)  # layer index 0 of the head's own cache
        self.final_norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.embed_tokens = target.model.embed_tokens
        self.rotary_emb = target.model.rotary_emb
        self.lm_head = target.lm_head

    def forward(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Draft logits ``[batch, k, vocab]`` for ``k`` new MTP positions.

        ``hidden_states[:, i]`` is the target's final-normed hidden state at sequence position
        ``position_ids[:, i]`` and ``next_token_ids[:, i]`` the token right after it; the output at ``i`` predicts
        the token after that one. With a ``cache``, the positions must continue the ones it already holds.
        """
        embedded = self.enorm(self.embed_tokens(next_token_ids))
        x = self.eh_proj(torch.cat([embedded, self.hnorm(hidden_states)], dim=-1))
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=cache, position_ids=position_ids
        )
        x = self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary_emb(x, position_ids),
        )
        return self.lm_head(self.final_norm(x))


def load_target(
    hf_path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The target model of an HF checkpoint, in eval mode.

    MiMo's main model is a plain Qwen2 (its remote code only declares the MTP layers), so it is loaded as
    ``Qwen2ForCausalLM`` and no remote code is executed.
    """
    hf_path = Path(hf_path)
    raw_config = _read_config(hf_path)
    # transformers reports the MTP tensors as unexpected (its classes have no MTP module); they are checked here.
    modeling_logger = logging.getLogger("transformers.modeling_utils")
    level = modeling_logger.level
    modeling_logger.setLevel(logging.ERROR)
    try:
        if raw_config.get("model_type") == "mimo":
            from transformers import Qwen2Config, Qwen2ForCausalLM

            fields = {k: v for k, v in raw_config.items() if k not in ("architectures", "auto_map", "model_type")}
            model, info = Qwen2ForCausalLM.from_pretrained(
                hf_path, config=Qwen2Config(**fields), dtype=dtype, output_loading_info=True
            )
        else:
            model, info = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype, output_loading_info=True)
    finally:
        modeling_logger.setLevel(level)
    not_mtp = [name for name in info["unexpected_keys"] if not name.startswith(MTP_PREFIXES)]
    if info["missing_keys"] or info["mismatched_keys"] or not_mtp:
        raise ValueError(
            f"{hf_path}: the target model does not load cleanly: missing={sorted(info['missing_keys'])}, "
            f"mismatched={info['mismatched_keys']}, unexpected={sorted(not_mtp)}"
        )
    return model.to(device).eval()


def load_mtp_head(hf_path: str | Path, target: PreTrainedModel) -> MTPDraftHead:
    """The MTP head stored in the HF checkpoint at ``hf_path``, on ``target``'s device and dtype, in eval mode.

    Only the MTP tensors are read from the safetensors. Raises ``ValueError`` when the checkpoint carries no MTP
    layer in a layout listed in :data:`LAYOUTS`.
    """
    hf_path = Path(hf_path)
    files = sorted(hf_path.glob("*.safetensors"))
    names = {name: file for file in files for name in _tensor_names(file)}
    layout = _detect_layout(hf_path, names)
    head = MTPDraftHead(target, layout)

    def read(name: str) -> torch.Tensor:
        with safe_open(names[name], framework="pt") as reader:
            return reader.get_tensor(name)

    projection = read(f"{layout.projection}.weight")
    if layout.hidden_first:
        hidden_half, embedding_half = projection.chunk(2, dim=1)
        projection = torch.cat([embedding_half, hidden_half], dim=1)
    layer_names = [f"{layout.layer_prefix}{name}" for name in head.layer.state_dict()]
    missing = [name for name in layer_names if name not in names]
    if missing:
        raise ValueError(f"{hf_path}: the {layout.family} MTP layer is missing tensors {missing}")
    head.enorm.load_state_dict({"weight": read(f"{layout.embedding_norm}.weight")})
    head.hnorm.load_state_dict({"weight": read(f"{layout.hidden_norm}.weight")})
    head.eh_proj.load_state_dict({"weight": projection})
    head.layer.load_state_dict({name.removeprefix(layout.layer_prefix): read(name) for name in layer_names})
    head.final_norm.load_state_dict({"weight": read(f"{layout.final_norm}.weight")})
    return head.to(device=target.device, dtype=target.dtype).eval()


def _detect_layout(hf_path: Path, tensor_names: Collection[str]) -> MTPLayout:
    """The MTP layout whose projection tensor the checkpoint holds."""
    for layout in LAYOUTS:
        if f"{layout.projection}.weight" in tensor_names:
            return layout
    known = ", ".join(f"{layout.family} ({layout.projection}.weight)" for layout in LAYOUTS)
    raise ValueError(
        f"{hf_path} has no MTP head in a layout this decoder knows: {known}. "
        "Export the checkpoint with its MTP head kept (ModelOptions(mtp=True))."
    )


def _read_config(hf_path: Path) -> dict:
    if not (hf_path / "config.json").is_file():
        raise ValueError(
            f"checkpoint: {hf_path} is not a Hugging Face checkpoint folder (no config.json). A Megatron distributed "
            "checkpoint from training must first be exported to HF format (the strategy's export_hf)."
        )
    return json.loads((hf_path / "config.json").read_text())


def _tensor_names(file: Path) -> list[str]:
    with safe_open(file, framework="pt") as reader:
        return list(reader.keys())
