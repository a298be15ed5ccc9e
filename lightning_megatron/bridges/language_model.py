"""The text model inside a multimodal checkpoint, built and exported by megatron-bridge's text bridge under the
checkpoint's own tensor names (Qwen3.5's published `qwen3_5` checkpoints: the family table's `LanguageModel`).

Why text only: what the package trains on these checkpoints is the language model and its MTP draft head, and a
draft head only ever sees text. transformers reads the same folder the same way (its `AutoModelForCausalLM` loads a
`qwen3_5` checkpoint as `Qwen3_5ForCausalLM`, dropping `model.visual.*`), and so do SGLang's and vLLM's MTP drafters.
megatron-bridge's multimodal bridge (`qwen_vl/qwen35_vl_bridge.py`) would build the vision tower too, but not without
Transformer Engine (its vision spec is TE's, `qwen35_vl_provider.py:502-529`), and the image path
(`lightning_megatron.vl`) trains no MTP head.

How: megatron-bridge picks its model bridge by the config's architecture, so the `AutoBridge` here reads the text
model's config (the checkpoint's `text_config`, as the text family's architecture) and renames every HF name of the
text bridge's mappings to the checkpoint's (`LanguageModel.checkpoint_name`: `model.` -> `model.language_model.`;
`lm_head` and `mtp.*` keep theirs). Loads then read and exports write the multimodal names directly; the vision
tower's tensors, which the model does not hold, are copied unchanged into every export by the HF writer
(`Bridge.unchanged_hf_tensors`), so an exported folder is the full multimodal checkpoint again.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from lightning_megatron.families import MODEL_FAMILIES, LanguageModel, text_model_config


def language_model_auto_bridge(auto_bridge_class: type, hf_path: Path, hf_config: dict[str, Any],
                               layout: LanguageModel, *, trust_remote_code: bool) -> Any:
    """megatron-bridge's `AutoBridge` (`auto_bridge_class`) for the text model of the multimodal checkpoint at
    `hf_path`, with the text bridge's mappings under the checkpoint's names."""
    auto_bridge = _renaming_auto_bridge_class(auto_bridge_class).from_hf_pretrained(
        str(hf_path), trust_remote_code=trust_remote_code)
    auto_bridge.language_model = layout
    use_text_config(auto_bridge.hf_pretrained, hf_config)
    return auto_bridge


def use_text_config(hf_pretrained: Any, hf_config: dict[str, Any]) -> None:
    """Make megatron-bridge's pretrained wrapper of a multimodal checkpoint describe its text model (what the
    library's bridge dispatch and provider read)."""
    from transformers import CONFIG_MAPPING

    fields = dict(text_model_config(hf_config))
    model_type = fields.pop("model_type")
    fields["architectures"] = [MODEL_FAMILIES[model_type].architecture]
    hf_pretrained.config = CONFIG_MAPPING[model_type](**fields)


@functools.cache
def _renaming_auto_bridge_class(auto_bridge_class: type) -> type:
    """`AutoBridge` whose model bridge maps the text model to the names of the multimodal checkpoint it is part of."""

    class LanguageModelAutoBridge(auto_bridge_class):  # type: ignore[misc, valid-type]
        language_model: LanguageModel

        @property
        def _model_bridge(self) -> Any:  # a new model bridge on every access, as upstream's
            bridge = super()._model_bridge
            registry = bridge.mapping_registry
            bridge.mapping_registry = lambda: _stored_under(registry(), self.language_model)
            return bridge

    return LanguageModelAutoBridge


def _stored_under(registry: Any, layout: LanguageModel) -> Any:
    """A mapping registry like `registry` whose HF names are the multimodal checkpoint's."""
    renamed = []
    for mapping in registry.mappings:
        mapping = copy.copy(mapping)
        hf_param = mapping.hf_param
        mapping.hf_param = (layout.checkpoint_name(hf_param) if isinstance(hf_param, str)
                            else {role: layout.checkpoint_name(name) for role, name in hf_param.items()})
        renamed.append(mapping)
    return type(registry)(*renamed)
