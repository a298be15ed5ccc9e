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
   `moe=True` if its MLPs are routed experts, `vl_name` if it is a vision-language model. A family that stores its
   MTP layers as decoder layers past `num_hidden_layers` (GLM-4.5, DeepSeek-V3) sets `MTPNames.after_decoder`: its
   names then need the checkpoint's config (`MTPNames.head(i, hf_config)`, `is_hf_mtp_tensor(name, hf_config)`),
   and `MTPNames.copies` lists the main-model tensors its checkpoints store again inside each MTP layer. A family
   with linear-attention layers (Qwen3.5's gated DeltaNet) sets `linear_attention=True`: the bridges then build it
   only where a backend lists it in `linear_attention_model_types`, and tree packing is refused. A multimodal
   checkpoint whose text model (and MTP head) the package trains text-only, its other towers copied unchanged into
   every export (Qwen3.5's published `qwen3_5` and `qwen3_5_moe` checkpoints), sets `language_model` to the text
   family it holds (`LanguageModel`): that family's entry must exist, and the multimodal entry repeats its `mtp`,
   `moe` and `linear_attention` (`vl_name` stays None: that is the image-training path of `lightning_megatron.vl`).
   Code that reads the text model's config or names goes through `text_model_config` and `checkpoint_name`.
2. Run `pytest tests/test_families.py tests/testing/test_checkpoints.py`: the consumer checks there say what else is
   needed.
   The tiny-checkpoint maker (`lightning_megatron.testing.checkpoints.make_tiny_checkpoint`, or
   `testing.vl.make_tiny_vl_checkpoint`) must learn to write the family (its config class and decoder-layer
   tensors) before the MTP-name checks can run on it; a family with MTP also needs its HF classes in
   `testing.references.hf_mtp_reference_logits`, and an MoE family its router fields in `lightning_megatron.moe`.
   A multimodal family with a `language_model` is written by `make_tiny_checkpoint` from its text family's tensors
   (renamed) plus its other towers (`testing.qwen3_5.multimodal_config`, `vision_tower_shapes` for Qwen3.5).
3. Then the bridge tests (`tests/bridges/test_bridges.py`, `tests/_compat/test_bridges.py`, `tests/test_moe.py`,
   `tests/vl/test_vl.py`, `tests/test_qwen3_5_vl.py`) tell whether the bridges map it. A bridge builds an MoE family
   only where it lists it in `moe_model_types`; without Transformer Engine the local spec builds `SequentialMLP`
   experts, so a megatron-bridge registry that maps only `TEGroupedMLP` expert names (an MTP layer's, often) needs
   `_compat.moe.install_sequential_expert_names` for its bridge class. Experts a checkpoint stores packed
   (Qwen3.5-MoE's `mlp.experts.gate_up_proj`) are read as they are by the references and the draft head
   (`hf_io.hf_module_state`), and a fresh MTP head stores them one by one (`mtp.restore`).
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
    after_decoder: bool = False  # MTP layer i is stored as decoder layer `num_hidden_layers + i` (GLM-4.5,
    # DeepSeek-V3): `{i}` in the names is that decoder-layer index, so naming a tensor needs the HF config
    copies: tuple[tuple[str, str], ...] = ()  # (main-model tensor, MTP layer's name for a copy of it): the shared
    # embedding and LM head some checkpoints store again inside each MTP layer (GLM-4.5's `shared_head.head`)

    @property
    def norms(self) -> tuple[str, str, str]:
        """The embedding norm, the hidden norm and the final norm."""
        return self.embedding_norm, self.hidden_norm, self.final_norm

    def index(self, i: int, hf_config: dict[str, Any] | None = None) -> int:
        """The `{i}` of MTP layer `i`'s names: `i` itself, or its decoder-layer index for `after_decoder` layouts."""
        if not self.after_decoder:
            return i
        if hf_config is None:
            raise ValueError(f"the MTP layout {self.layer!r} numbers MTP layers after the decoder's layers: pass "
                             "the checkpoint's config (num_hidden_layers) to name its tensors")
        return int(hf_config["num_hidden_layers"]) + i

    def head(self, i: int, hf_config: dict[str, Any] | None = None) -> dict[str, str]:
        """MTP layer `i`'s own tensors (not its decoder sub-layer, not its copies): role -> HF name."""
        index = self.index(i, hf_config)
        return {"projection": self.projection.format(i=index), "embedding_norm": self.embedding_norm.format(i=index),
                "hidden_norm": self.hidden_norm.format(i=index), "final_norm": self.final_norm.format(i=index)}

    def layer_prefix(self, i: int, hf_config: dict[str, Any] | None = None) -> str:
        """The prefix of MTP layer `i`'s decoder sub-layer tensors."""
        return self.layer.format(i=self.index(i, hf_config))

    def copy_names(self, i: int, hf_config: dict[str, Any] | None = None) -> dict[str, str]:
        """MTP layer `i`'s copies of main-model tensors: main-model name -> the copy's HF name."""
        index = self.index(i, hf_config)
        return {main: copy.format(i=index) for main, copy in self.copies}

    def copy_sources(self, i: int, hf_config: dict[str, Any]) -> dict[str, str]:
        """MTP layer `i`'s copies of main-model tensors: the copy's HF name -> the tensor it is written from, which is
        the input embedding for the LM head's copy where the checkpoint ties them (`tie_word_embeddings`: it stores
        no `lm_head.weight`)."""
        tied = bool(text_model_config(hf_config).get("tie_word_embeddings"))
        return {copy: _EMBEDDING if tied and main == _LM_HEAD else main
                for main, copy in self.copy_names(i, hf_config).items()}

    def layer_prefixes(self, hf_config: dict[str, Any]) -> tuple[str, ...]:
        """The name prefix of every MTP tensor of a checkpoint with this config (its declared MTP layers)."""
        if not self.after_decoder:
            return (self.prefix,)
        return tuple(self.prefix.format(i=self.index(i, hf_config)) for i in range(checkpoint_mtp_layers(hf_config)))


_EMBEDDING, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class LanguageModel:
    """Where a multimodal checkpoint keeps the text model the package trains on it, text only.

    Its config.json holds the text family's config under `text_config`; the text family's `model.*` tensors are
    stored under `prefix`, its LM head and MTP head under their own names, and the other towers' tensors (the vision
    tower: `other_prefixes`) are copied unchanged into every export, so the exported folder is still the multimodal
    checkpoint inference engines serve. A draft head only ever sees text, so MTP training needs no image.
    """

    model_type: str  # the text family (an entry of `MODEL_FAMILIES`)
    prefix: str  # where the text family's `model.` tensors are stored
    other_prefixes: tuple[str, ...]  # the tensors of the other towers, which the text model does not hold

    def checkpoint_name(self, text_name: str) -> str:
        """The multimodal checkpoint's name of a text-family tensor name."""
        return self.prefix + text_name.removeprefix(_TEXT_MODEL_PREFIX) if text_name.startswith(
            _TEXT_MODEL_PREFIX) else text_name

    def text_name(self, name: str) -> str | None:
        """The text-family name of a multimodal checkpoint's tensor; None for another tower's."""
        if name.startswith(self.other_prefixes):
            return None
        return _TEXT_MODEL_PREFIX + name.removeprefix(self.prefix) if name.startswith(self.prefix) else name


_TEXT_MODEL_PREFIX = "model."


@dataclass(frozen=True)
class ModelFamily:
    """What the package knows about one HF `model_type`."""

    model_type: str
    architecture: str  # the HF class config.json's `architectures` names
    mtp: MTPNames | None = None  # None: the family has no MTP head
    moe: bool = False  # routed experts (in every layer, or after `first_k_dense_replace` dense ones)
    vl_name: str | None = None  # the vision-language model's display name; None for a text model
    linear_attention: bool = False  # some decoder layers are linear attention (Qwen3.5's gated DeltaNet): its state
    # runs along the whole row, so a packed row or a tree is not a mask over tokens
    language_model: LanguageModel | None = None  # a multimodal checkpoint trained as the text model it holds
    zero_centered_norms: bool = False  # its RMSNorms scale by `1 + weight` (Qwen3.5's): a fresh norm is zeros


# GLM-4.5 / GLM-4.5-Air / GLM-4.6 (zai-org; megatron-bridge glm/glm45_bridge.py): each MTP layer is stored as one
# more decoder layer (with routed experts), plus its own norms, projection and copies of the embedding and LM head.
_GLM4_MOE_LAYER = "model.layers.{i}."
_GLM4_MOE_MTP = MTPNames(
    prefix=_GLM4_MOE_LAYER,
    layer=_GLM4_MOE_LAYER,
    projection=_GLM4_MOE_LAYER + "eh_proj.weight",
    embedding_norm=_GLM4_MOE_LAYER + "enorm.weight",
    hidden_norm=_GLM4_MOE_LAYER + "hnorm.weight",
    final_norm=_GLM4_MOE_LAYER + "shared_head.norm.weight",
    after_decoder=True,
    copies=((_EMBEDDING, _GLM4_MOE_LAYER + "embed_tokens.weight"),
            (_LM_HEAD, _GLM4_MOE_LAYER + "shared_head.head.weight")),
)
# DeepSeek-V3 (and Kimi-K2, Moonlight; megatron-bridge deepseek/deepseek_v3_bridge.py, deepseek/common.py) is the
# layout GLM-4.5 took over: DeepSeek-V3's index lists model.layers.61.{enorm, hnorm, eh_proj, shared_head.norm,
# shared_head.head, embed_tokens} beside the MTP layer's self_attn.* (MLA) and mlp.* (routed experts) tensors.
_DEEPSEEK_V3_MTP = _GLM4_MOE_MTP
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
# layer as Qwen3-Next does, under Qwen3's names, and declares it as `mtp_num_hidden_layers`. Qwen3.5-MoE
# (Qwen/Qwen3.5-35B-A3B ... 397B-A17B, text model `qwen3_5_moe_text`) has the same head, its layer with routed experts
# (stored one by one, where its decoder layers store them packed: `mlp.experts.gate_up_proj`; Qwen3.6 packs both).
_QWEN3_5_MTP = replace(_QWEN3_MTP, layers_key="mtp_num_hidden_layers")
# The checkpoints Qwen publishes (Qwen/Qwen3.5-0.8B ... 27B) are multimodal (`Qwen3_5ForConditionalGeneration`): the
# text model under `model.language_model.`, the vision tower under `model.visual.`, `lm_head` and the MTP head `mtp.*`
# at the top (megatron-bridge qwen_vl/qwen35_vl_bridge.py; transformers loads the same folder as Qwen3_5ForCausalLM).
_QWEN3_5_LANGUAGE_MODEL = LanguageModel("qwen3_5_text", prefix="model.language_model.",
                                        other_prefixes=("model.visual.",))
# Qwen3.5-MoE's published checkpoints (Qwen/Qwen3.5-35B-A3B ... 397B-A17B: `Qwen3_5MoeForConditionalGeneration`) lay
# their text model out the same way (megatron-bridge qwen_vl/qwen35_vl_bridge.py `Qwen35VLMoEBridge`).
_QWEN3_5_MOE_LANGUAGE_MODEL = replace(_QWEN3_5_LANGUAGE_MODEL, model_type="qwen3_5_moe_text")

MODEL_FAMILIES: dict[str, ModelFamily] = {
    entry.model_type: entry
    for entry in (
        ModelFamily("qwen3", "Qwen3ForCausalLM", mtp=_QWEN3_MTP),
        ModelFamily("qwen2", "Qwen2ForCausalLM"),
        ModelFamily("llama", "LlamaForCausalLM"),
        ModelFamily("mimo", "MiMoForCausalLM", mtp=_MIMO_MTP),
        ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM", mtp=_QWEN3_MTP, moe=True),
        ModelFamily("qwen2_moe", "Qwen2MoeForCausalLM", moe=True),
        ModelFamily("glm4_moe", "Glm4MoeForCausalLM", mtp=_GLM4_MOE_MTP, moe=True),
        ModelFamily("qwen3_5_text", "Qwen3_5ForCausalLM", mtp=_QWEN3_5_MTP, linear_attention=True,
                    zero_centered_norms=True),
        ModelFamily("qwen3_5", "Qwen3_5ForConditionalGeneration", mtp=_QWEN3_5_MTP, linear_attention=True,
                    language_model=_QWEN3_5_LANGUAGE_MODEL, zero_centered_norms=True),
        ModelFamily("deepseek_v3", "DeepseekV3ForCausalLM", mtp=_DEEPSEEK_V3_MTP, moe=True),
        ModelFamily("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", mtp=_QWEN3_5_MTP, moe=True, linear_attention=True,
                    zero_centered_norms=True),
        ModelFamily("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", mtp=_QWEN3_5_MTP, moe=True,
                    linear_attention=True, language_model=_QWEN3_5_MOE_LANGUAGE_MODEL, zero_centered_norms=True),
        ModelFamily("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", vl_name="Qwen2.5-VL"),
        ModelFamily("qwen3_vl", "Qwen3VLForConditionalGeneration", vl_name="Qwen3-VL"),
    )
}
"""Every HF `model_type` the package knows, in a fixed order (error messages list them in it)."""

MTP_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.mtp is not None)
MOE_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.moe)
VL_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.vl_name is not None)
LINEAR_ATTENTION_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.linear_attention)
LANGUAGE_MODEL_TYPES = tuple(name for name, entry in MODEL_FAMILIES.items() if entry.language_model is not None)
"""The multimodal families trained as the text model they hold (`LanguageModel`)."""


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


MTP_PREFIXES = tuple(dict.fromkeys(names.prefix for names in distinct_mtp_names() if not names.after_decoder))
"""The name prefixes of the MTP tensors of every table family whose MTP names do not depend on the config: what an
HF model class without MTP leaves unloaded (`after_decoder` layouts: `mtp_prefixes(hf_config)`)."""


def mtp_prefixes(hf_config: dict[str, Any] | None) -> tuple[str, ...]:
    """The name prefixes of the MTP tensors of a checkpoint with this config, whatever its layout."""
    entry = MODEL_FAMILIES.get((hf_config or {}).get("model_type"))
    if entry is None or entry.mtp is None or not entry.mtp.after_decoder:
        return MTP_PREFIXES
    return (*MTP_PREFIXES, *entry.mtp.layer_prefixes(hf_config))


def is_hf_mtp_tensor(name: str, hf_config: dict[str, Any] | None = None) -> bool:
    """Whether an HF tensor name belongs to an MTP head, of any family (the one definition the package uses).

    The layouts that store MTP layers after the decoder's (`MTPNames.after_decoder`) are recognised only with the
    checkpoint's config (`num_hidden_layers` and the MTP layer count say which decoder layers are MTP layers).
    """
    return name.startswith((*mtp_prefixes(hf_config), *_OTHER_MTP_PREFIXES)) or _OTHER_MTP_INFIX in name


def checkpoint_mtp_layers(hf_config: dict[str, Any]) -> int:
    """How many MTP layers an HF config declares (0 when none), whatever key its family uses (in the text model's
    config of a multimodal checkpoint)."""
    config = text_model_config(hf_config)
    return max((int(config.get(key) or 0) for key in MTP_CONFIG_KEYS), default=0)


def language_model(hf_config: dict[str, Any] | None) -> LanguageModel | None:
    """Where a multimodal checkpoint of this config keeps its text model; None for a text checkpoint."""
    entry = MODEL_FAMILIES.get((hf_config or {}).get("model_type"))
    return None if entry is None else entry.language_model


def text_model_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model a checkpoint holds: its own, or a multimodal checkpoint's `text_config` with the
    top-level `tie_word_embeddings` (where such checkpoints declare it)."""
    if language_model(hf_config) is None:
        return hf_config
    return {**hf_config["text_config"], "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False))}


def layer_types(hf_config: dict[str, Any]) -> list[str]:
    """The kind of each decoder layer of a checkpoint's text model, as transformers reads config.json: its
    `layer_types`, or for a linear-attention family (Qwen3.5) the pattern `full_attention_interval` (4 when absent)
    implies, every interval-th layer full attention (`Qwen3_5TextConfig.__post_init__`); empty for other configs
    without `layer_types`."""
    config = text_model_config(hf_config)
    if config.get("layer_types"):
        return list(config["layer_types"])
    entry = MODEL_FAMILIES.get(hf_config.get("model_type"))
    if entry is None or not entry.linear_attention:
        return []
    interval = int(config.get("full_attention_interval") or 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(int(config["num_hidden_layers"]))]


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE of a checkpoint's text model in transformers 5's `rope_parameters` form (`rope_type`, `rope_theta`,
    `partial_rotary_factor`, the scaling fields), whichever form its config.json has: `rope_parameters`, or
    transformers 4's top-level `rope_theta`, `partial_rotary_factor` and `rope_scaling` (`type` or `rope_type`; null
    for plain RoPE) that most published checkpoints keep. Read as transformers reads it
    (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`): `rope_scaling` first, the dict's values before the
    top-level ones."""
    config = text_model_config(hf_config)
    declared = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope = {key: value for key, value in declared.items() if key != "type"}
    rope["rope_type"] = declared.get("rope_type") or declared.get("type") or "default"
    for key in ("rope_theta", "partial_rotary_factor"):
        if rope.get(key) is None and config.get(key) is not None:
            rope[key] = config[key]
    return rope


def quantization_refusal(hf_config: dict[str, Any], where: str) -> str | None:
    """Why a checkpoint whose config.json declares `quantization_config` is refused (None where it declares none).

    Quantized weights (DeepSeek-V3's published fp8: float8_e4m3fn weights beside `weight_scale_inv` tensors of one
    scale per 128x128 block; GLM-4.5-Air-FP8, Qwen3-8B-FP8) are not plain tensors: training, exports and MTP restores
    read and write full-precision weights, and a config.json left declaring `quantization_config` beside bf16 weights
    makes transformers and inference engines quantize or misread them. `where`: the option or file to name.
    """
    quantization = hf_config.get("quantization_config") or text_model_config(hf_config).get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    return (f"{where}: config.json declares quantization_config (quant_method: {method!r}), quantized weights this "
            "package does not train or export; convert the checkpoint to bf16 first (DeepSeek-V3's fp8: "
            "inference/fp8_cast_bf16.py of deepseek-ai/DeepSeek-V3, which writes w = fp8 * weight_scale_inv per "
            "128x128 block and drops the scales) and delete quantization_config from the converted config.json")


def checkpoint_name(hf_config: dict[str, Any], text_name: str) -> str:
    """Where a checkpoint of this config stores the text-family tensor `text_name` (`model.embed_tokens.weight`):
    under that name, or under its multimodal name (`LanguageModel.checkpoint_name`)."""
    layout = language_model(hf_config)
    return text_name if layout is None else layout.checkpoint_name(text_name)


def with_text_model_fields(hf_config: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A copy of `hf_config` with `fields` set in its text model's config (`text_config` of a multimodal one)."""
    if language_model(hf_config) is None:
        return {**hf_config, **fields}
    return {**hf_config, "text_config": {**hf_config["text_config"], **fields}}
