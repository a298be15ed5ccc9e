"""One declarative table per model family: what the rest of the package must know about each HF layout.

Every HF `model_type` the package knows has one `ModelFamily` entry in `MODEL_FAMILIES`: its HF architecture
class, the HF names of its MTP head (`MTPNames`, or None for a plain decoder), and whether it is MoE or
vision-language. This is the only place in the package where an HF MTP tensor name is spelled: the restore tool,
the speculative decoder, the bridges' export filter, the tiny-checkpoint makers, the recipes and `_compat`'s
megatron-bridge mappings all read it (tests/test_families.py fails on a spelling anywhere else). Megatron's own
parameter names (`mtp.layers.0.eh_proj.weight`, ...) stay with the code that maps them.

A ground-floor leaf: it imports nothing of `lightning_megatron`, so every room may read it, `_compat` included.

How to add a model family:

1. Add one `ModelFamily` entry to `MODEL_FAMILIES`: the `model_type` of its config.json, its HF architecture class,
   its `MTPNames` if its checkpoints carry an MTP head (the names its megatron-bridge / mbridge mapping reads),
   `moe=True` if every MLP is routed experts, `vl_name` if it is a vision-language model.
2. Run `pytest tests/test_families.py tests/testing/test_checkpoints.py`: the consumer checks there say what else is
   needed.
   The tiny-checkpoint maker (`lightning_megatron.testing.checkpoints.make_tiny_checkpoint`, or
   `testing.vl.make_tiny_vl_checkpoint`) must learn to write the family (its config class and decoder-layer
   tensors) before the MTP-name checks can run on it; a family with MTP also needs its HF classes in
   `testing.references.hf_mtp_reference_logits`, and an MoE family its router fields in `lightning_megatron.moe`.
3. Then the bridge tests (`tests/bridges/test_bridges.py`, `tests/_compat/test_bridges.py`, `tests/test_moe.py`,
   `tests/vl/test_vl.py`) tell whether the bridges map it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
"""The config keys under which model families declare their MTP layer count (any family's, not only the table's)."""

# MTP heads of layouts not in the table (`model.mtp.*`, or `*.mtp.*` under a wrapper module): an export without
# MTP drops them too rather than writing a head the config no longer declares.
_OTHER_MTP_PREFIXES = ("model.mtp.",)
_OTHER_MTP_INFIX = ".mtp."


@dataclass(frozen=True)
class MTPNames:
    """Where a family keeps its MTP head, in HF tensor names; `{i}` stands for the MTP layer's index.

    An MTP layer combines the final-normed hidden state `h` and the next token's embedding `e`:
    `projection(cat(embedding_norm(e), hidden_norm(h)))` (or `cat(hidden, embedding)` when `hidden_first`), then
    one decoder layer under `layer` (named as in the main decoder's layers), then `final_norm`.
    """

    prefix: str  # every MTP tensor's name starts with it
    layer: str  # MTP layer i's decoder sub-layer: below it, the same names as in a decoder layer
    projection: str  # the [embedding, hidden] -> hidden projection's weight
    embedding_norm: str
    hidden_norm: str
    final_norm: str
    hidden_first: bool = False  # the projection's input is cat([hidden, embedding]) (MiMo); Megatron's eh_proj is
    # cat([embedding, hidden]), so the bridges swap its column halves on load
    layers_key: str = "num_nextn_predict_layers"  # the config key its checkpoints declare the MTP layer count under

    @property
    def norms(self) -> tuple[str, str, str]:
        """The embedding norm, the hidden norm and the final norm."""
        return self.embedding_norm, self.hidden_norm, self.final_norm

    def head(self, i: int) -> dict[str, str]:
        """MTP layer `i`'s own tensors (not its decoder sub-layer): role -> HF name."""
        return {"projection": self.projection.format(i=i), "embedding_norm": self.embedding_norm.format(i=i),
                "hidden_norm": self.hidden_norm.format(i=i), "final_norm": self.final_norm.format(i=i)}


@dataclass(frozen=True)
class ModelFamily:
    """What the package knows about one HF `model_type`."""

    model_type: str
    architecture: str  # the HF class config.json's `architectures` names
    mtp: MTPNames | None = None  # None: the family has no MTP head
    moe: bool = False  # every MLP is routed experts
    vl_name: str | None = None  # the vision-language model's display name; None for a text model
    linear_attention: bool = False  # some decoder layers are linear attention (Qwen3.5's gated DeltaNet): its state
    # runs along the whole row, so a packed row or a tree is not a mask over tokens


# Qwen3 (and Qwen3-MoE, which lays its MTP layer out as Qwen3-Next does, routed experts in the layer) keeps one
# projection and one set of norms whatever the layer count (megatron-bridge 0.6.2 maps layer 0 only,
# qwen/qwen3_bridge.py); MiMo (XiaomiMiMo/MiMo-7B, mimo/mimo_bridge.py) keeps them per layer.
_QWEN3_MTP = MTPNames(
    prefix="mtp.",
    layer="mtp.layers.{i}.",
    projection="mtp.fc.weight",
    embedding_norm="mtp.pre_fc_norm_embedding.weight",
    hidden_norm="mtp.pre_fc_norm_hidden.weight",
    final_norm="mtp.norm.weight",
)
_MIMO_MTP = MTPNames(
    prefix="model.mtp_layers.",
    layer="model.mtp_layers.{i}.",
    projection="model.mtp_layers.{i}.input_proj.weight",
    embedding_norm="model.mtp_layers.{i}.token_layernorm.weight",
    hidden_norm="model.mtp_layers.{i}.hidden_layernorm.weight",
    final_norm="model.mtp_layers.{i}.final_layernorm.weight",
    hidden_first=True,
)
# Qwen3.5 (Qwen/Qwen3.5-0.8B ... 27B, text model `qwen3_5_text`; megatron-bridge qwen/qwen35_bridge.py) stores its MTP
# layer as Qwen3-Next does, under Qwen3's names, and declares it as `mtp_num_hidden_layers`.
_QWEN3_5_MTP = replace(_QWEN3_MTP, layers_key="mtp_num_hidden_layers")

MODEL_FAMILIES: dict[str, ModelFamily] = {
    entry.model_type: entry
    for entry in (
        ModelFamily("qwen3", "Qwen3ForCausalLM", mtp=_QWEN3_MTP),
        ModelFamily("qwen2", "Qwen2ForCausalLM"),
        ModelFamily("llama", "LlamaForCausalLM"),
        ModelFamily("mimo", "MiMoForCausalLM", mtp=_MIMO_MTP),
        ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM", mtp=_QWEN3_MTP, moe=True),
        ModelFamily("qwen2_moe", "Qwen2MoeForCausalLM", moe=True),
        ModelFamily("qwen3_5_text", "Qwen3_5ForCausalLM", mtp=_QWEN3_5_MTP, linear_attention=True),
        ModelFamily("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", vl_name="Qwen2.5-VL"),
        ModelFamily("qwen3_vl", "Qwen3VLForConditionalGeneration", vl_name="Qwen3-VL"),
    )
}
"""Every HF `model_type` the package knows, in a fixed order (error messages list them in it)."""

MTP_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.mtp is not None)
MOE_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.moe)
VL_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.vl_name is not None)
LINEAR_ATTENTION_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.linear_attention)


def family(model_type: str | None) -> ModelFamily:
    """The table entry of an HF `model_type` (config.json's `model_type`)."""
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type: {model_type!r} is not a family this package knows; the known ones are "
                         f"{', '.join(MODEL_FAMILIES)} (add an entry to lightning_megatron.families.MODEL_FAMILIES)")
    return MODEL_FAMILIES[model_type]


def mtp_names(model_type: str) -> MTPNames:
    """The HF names of a family's MTP head, for code that handles one family's head by name."""
    names = family(model_type).mtp
    if names is None:
        raise ValueError(f"model_type: {model_type!r} has no MTP head; the families with one are "
                         f"{', '.join(MTP_MODEL_TYPES)}")
    return names


def distinct_mtp_names() -> dict[MTPNames, str]:
    """Each MTP layout once, with the first family (in table order) that uses it: the layouts a checkpoint is
    recognised by when its `model_type` alone does not say (Qwen3-MoE shares Qwen3's)."""
    layouts: dict[MTPNames, str] = {}
    for name, entry in MODEL_FAMILIES.items():
        if entry.mtp is not None:
            layouts.setdefault(entry.mtp, name)
    return layouts


MTP_PREFIXES = tuple(dict.fromkeys(names.prefix for names in distinct_mtp_names()))
"""The name prefixes of every table family's MTP tensors: what an HF model class without MTP leaves unloaded."""


def is_hf_mtp_tensor(name: str) -> bool:
    """Whether an HF tensor name belongs to an MTP head, of any family (the one definition the package uses)."""
    return name.startswith((*MTP_PREFIXES, *_OTHER_MTP_PREFIXES)) or _OTHER_MTP_INFIX in name


def checkpoint_mtp_layers(hf_config: dict[str, Any]) -> int:
    """How many MTP layers an HF config declares (0 when none), whatever key its family uses."""
    return max((int(hf_config.get(key) or 0) for key in MTP_CONFIG_KEYS), default=0)
