"""The text model inside a multimodal checkpoint, built and exported by megatron-bridge's text bridge under the
checkpoint's own tensor names (Qwen3.5's published `qwen3_5` and `qwen3_5_moe` checkpoints: the family table's
`LanguageModel`).

Why text only: what the package trains on these checkpoints is the language model and its MTP draft head, and a
draft head only ever sees text. transformers reads the same folder the same way (its `AutoModelForCausalLM` loads a
`qwen3_5` checkpoint as `Qwen3_5ForCausalLM` and a `qwen3_5_moe` one as `Qwen3_5MoeForCausalLM`, dropping
`model.visual.*`), and so do SGLang's and vLLM's MTP drafters.
megatron-bridge's multimodal bridge (`qwen_vl/qwen35_vl_bridge.py`) would build the vision tower too, but not without
Transformer Engine (its vision spec is TE's, `qwen35_vl_provider.py:502-529`), and the image path
(`lightning_megatron.vl`) trains no MTP head.

How: megatron-bridge picks its model bridge by the config's architecture, so the `AutoBridge` here reads the text
model's config (the checkpoint's `text_config`, as the text family's architecture) and renames every HF name of the
text bridge's mappings to the checkpoint's (`LanguageModel.checkpoint_name`: `model.` -> `model.language_model.`;
`lm_head` and `mtp.*` keep theirs). Loads then read and exports write the multimodal names directly; the vision
tower's tensors, which the model does not hold, are copied unchanged into every export by the HF writer
(`Bridge.unchanged_hf_tensors`), so an exported folder is the full multimodal checkpoint again. A text bridge that
picks its mappings by the checkpoint's tensor names (Qwen3.5-MoE's, whose experts may be stored packed or one by one:
it looks under `model.layers.`, `qwen/qwen35_bridge.py` `Qwen35MoEBridge.mapping_registry`) is shown the text model's
names while it picks them.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from types import SimpleNamespace
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
            registry, layout = bridge.mapping_registry, self.language_model

            def registry_under_checkpoint_names() -> Any:
                pretrained = bridge.hf_pretrained  # upstream's checkpoint wrapper, set before it asks for mappings
                bridge.hf_pretrained = _TextModelNames(pretrained, layout)
                try:
                    return _stored_under(registry(), layout)
                finally:
                    bridge.hf_pretrained = pretrained

            bridge.mapping_registry = registry_under_checkpoint_names
            return bridge

    return LanguageModelAutoBridge


class _TextModelNames:
    """What a model bridge holds as `hf_pretrained` (megatron-bridge's wrapper of the multimodal checkpoint, or a bare
    config), its tensor names (`state.source.get_all_keys()`) the text model's (`LanguageModel.text_name`); everything
    else is the original's."""

    def __init__(self, pretrained: Any, layout: LanguageModel) -> None:
        self._pretrained = pretrained
        self._layout = layout

    @property
    def state(self) -> Any:
        # an AttributeError where the original holds no checkpoint (a config), as upstream's `hasattr` checks expect
        source = self._pretrained.state.source

        def text_model_keys() -> list[str]:
            names = (self._layout.text_name(name) for name in source.get_all_keys())
            return [name for name in names if name is not None]

        return SimpleNamespace(source=SimpleNamespace(get_all_keys=text_model_keys))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pretrained, name)


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
