"""The MTP draft head on the Hugging Face side, and loading a target model with its head from an HF checkpoint.

Megatron-Core 0.19's MTP layer (``MultiTokenPredictionLayer``) reads the main decoder's output *after* its final
norm: at position ``t`` it combines that hidden state ``h_t`` with the embedding of token ``t+1``, runs one decoder
layer at rotary position ``t`` and predicts token ``t+2`` through the shared output layer. :class:`MTPDraftHead`
computes exactly that with the target's own Hugging Face modules (the same decoder-layer and norm classes, the
shared embedding, rotary embedding and LM head), plus a KV cache of its own, so that it can draft one token per
decoding step without re-reading the prefix. ``lightning_megatron.testing.references.hf_mtp_reference_logits`` is
the independent, cache-free statement of the same computation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from lightning_megatron.families import (
    LINEAR_ATTENTION_MODEL_TYPES,
    MODEL_FAMILIES,
    MTPNames,
    distinct_mtp_names,
    mtp_prefixes,
    quantization_refusal,
)
from lightning_megatron.hf_io import hf_module_state, rotary_position_ids


class MTPDraftHead(nn.Module):
    """One MTP layer that drafts token ``t+2`` from the target's final-normed hidden state at ``t`` and token ``t+1``.

    ``eh_proj`` takes ``cat([embedding, hidden])`` as in Megatron (MiMo's ``input_proj`` halves are swapped on load).
    The embedding, rotary embedding and LM head are the target's own modules, shared rather than copied, so a tied
    or later-trained LM head is always the one the target uses.
    """

    def __init__(self, target: PreTrainedModel, family: str, names: MTPNames) -> None:
        super().__init__()
        config = target.config
        self.family, self.names = family, names  # the HF layout it was loaded from
        norm_class, layer_class = type(target.model.norm), type(target.model.layers[0])
        self.config = config
        self.enorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        # Built as the decoder layer the checkpoint stores it as (GLM-4.5's MTP layer, past its dense layers, has
        # routed experts; Qwen3.5's is a full-attention layer); its attention is layer 0 of the head's own cache.
        self.layer = layer_class(config, layer_idx=_mtp_layer_kind(config, names))
        self.layer.self_attn.layer_idx = 0
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
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft logits ``[batch, k, vocab]`` for ``k`` new MTP positions.

        ``hidden_states[:, i]`` is the target's final-normed hidden state at sequence position
        ``position_ids[:, i]`` and ``next_token_ids[:, i]`` the token right after it; the output at ``i`` predicts
        the token after that one. With a ``cache``, the positions must continue the ones it already holds.
        ``attention_mask`` (``[batch, cached + k]``, 0 at slots no position may read: padding, discarded drafts)
        lets rows of a batch hold different positions in the same cache slots.
        """
        return self.lm_head(self.hidden(hidden_states, next_token_ids, position_ids, cache, attention_mask))

    def hidden(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The head's final-normed output ``[batch, k, hidden]`` (what :meth:`forward` projects to logits). Applied
        recursively, it stands in for the target's hidden state one position on: Megatron-Core chains MTP depths on
        this output, and multi-token drafting feeds it back with the head's own draft (SGLang's NEXTN steps)."""
        embedded = self.enorm(self.embed_tokens(next_token_ids))
        x = self.eh_proj(torch.cat([embedded, self.hnorm(hidden_states)], dim=-1))
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=attention_mask, past_key_values=cache,
            position_ids=position_ids,
        )
        x = self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary_emb(x, rotary_position_ids(self.rotary_emb, position_ids)),
        )
        return self.final_norm(x)


def _mtp_layer_kind(config: PretrainedConfig, names: MTPNames) -> int:
    """The decoder layer an MTP layer is built as: a hybrid model's (Qwen3.5's) first full-attention layer, the kind
    its MTP layer is; else the decoder layer the checkpoint stores it as (`MTPNames.index`)."""
    if config.model_type in LINEAR_ATTENTION_MODEL_TYPES:
        return config.layer_types.index("full_attention")
    return names.index(0, config.to_dict())


# what transformers says while loading these checkpoints that a user can do nothing about: the MTP tensors as
# unexpected (its classes have no MTP module; `load_target` checks them), "layers not sharded" (its tensor-parallel
# plan check, which `modeling_utils` runs whenever its own logger is quieted; one device shards nothing) and, reading
# MiMo's config for the tokenizer, "a model of type `mimo`"
_LOADING_LOGGERS = ("transformers.modeling_utils", "transformers.integrations.tensor_parallel",
                    "transformers.configuration_utils")


@contextmanager
def quiet_loading(progress_bar: bool = True) -> Iterator[None]:
    """transformers' loading messages above at ERROR only, and its per-tensor progress bar unless `progress_bar`."""
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(name) for name in _LOADING_LOGGERS]
    levels = [logger.level for logger in loggers]
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    if not progress_bar:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if bar_was_enabled:
            hf_logging.enable_progress_bar()


def load_target(
    hf_path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The target model of an HF checkpoint, in eval mode.

    MiMo's main model is a plain Qwen2 (its remote code only declares the MTP layers), so it is loaded as
    ``Qwen2ForCausalLM`` and no remote code is executed.
    """
    hf_path = Path(hf_path)
    raw_config = _read_config(hf_path)
    with quiet_loading():
        if raw_config.get("model_type") == "mimo":
            from transformers import Qwen2Config, Qwen2ForCausalLM

            fields = {k: v for k, v in raw_config.items() if k not in ("architectures", "auto_map", "model_type")}
            model, info = Qwen2ForCausalLM.from_pretrained(
                hf_path, config=Qwen2Config(**fields), dtype=dtype, output_loading_info=True
            )
        else:
            model, info = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype, output_loading_info=True)
    not_mtp = [name for name in info["unexpected_keys"] if not name.startswith(mtp_prefixes(raw_config))]
    state = model.state_dict()  # tensors without elements (a shared MLP of n_shared_experts: 0) are in no checkpoint
    missing = sorted(name for name in info["missing_keys"] if name not in state or state[name].numel())
    if missing or info["mismatched_keys"] or not_mtp:
        raise ValueError(
            f"{hf_path}: the target model does not load cleanly: missing={missing}, "
            f"mismatched={info['mismatched_keys']}, unexpected={sorted(not_mtp)}"
        )
    return model.to(device).eval()


def load_mtp_head(hf_path: str | Path, target: PreTrainedModel) -> MTPDraftHead:
    """The MTP head stored in the HF checkpoint at ``hf_path``, on ``target``'s device and dtype, in eval mode.

    Only the MTP tensors are read from the safetensors. Raises ``ValueError`` when the checkpoint carries no MTP
    layer in a layout of :data:`lightning_megatron.families.MODEL_FAMILIES`.
    """
    hf_path = Path(hf_path)
    files = sorted(hf_path.glob("*.safetensors"))
    tensor_files = {name: file for file in files for name in _tensor_names(file)}
    hf_config = target.config.to_dict()
    family, names = _detect_layout(hf_path, tensor_files, hf_config)
    head = MTPDraftHead(target, family, names)
    tensors, layer_prefix = names.head(0, hf_config), names.layer_prefix(0, hf_config)

    def read(name: str) -> torch.Tensor:
        with safe_open(tensor_files[name], framework="pt") as reader:
            return reader.get_tensor(name)

    projection = read(tensors["projection"])
    if names.hidden_first:
        hidden_half, embedding_half = projection.chunk(2, dim=1)
        projection = torch.cat([embedding_half, hidden_half], dim=1)
    def read_layer_tensor(name: str) -> torch.Tensor:
        if name not in tensor_files:
            raise ValueError(f"{hf_path}: the {family} MTP layer is missing the tensor {name}")
        return read(name)

    layer_state = hf_module_state(head.layer.state_dict(), read_layer_tensor, layer_prefix, tensor_files)
    head.enorm.load_state_dict({"weight": read(tensors["embedding_norm"])})
    head.hnorm.load_state_dict({"weight": read(tensors["hidden_norm"])})
    head.eh_proj.load_state_dict({"weight": projection})
    head.layer.load_state_dict(layer_state)
    head.final_norm.load_state_dict({"weight": read(tensors["final_norm"])})
    return head.to(device=target.device, dtype=target.dtype).eval()


def _detect_layout(hf_path: Path, tensor_names: Collection[str], hf_config: dict) -> tuple[str, MTPNames]:
    """The family and MTP names whose projection the checkpoint holds: the checkpoint's own family's when it has
    them (Qwen3.5 spells its head as Qwen3 does), else the first family in the table with these names."""
    layouts = distinct_mtp_names()
    own = MODEL_FAMILIES.get(hf_config.get("model_type"))
    if own is not None and own.mtp is not None:
        layouts = {own.mtp: own.model_type, **{names: name for names, name in layouts.items() if names != own.mtp}}
    for names, family in layouts.items():
        if names.head(0, hf_config)["projection"] in tensor_names:
            return family, names
    known = ", ".join(f"{family} ({names.head(0, hf_config)['projection']})" for names, family in layouts.items())
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
    config = json.loads((hf_path / "config.json").read_text())
    refusal = quantization_refusal(config, f"checkpoint: {hf_path}")  # its MTP tensors would be read without scales
    if refusal is not None:
        raise ValueError(refusal)
    return config


def _tensor_names(file: Path) -> list[str]:
    with safe_open(file, framework="pt") as reader:
        return list(reader.keys())
