"""The family table is the one spelling of each family's HF names: every consumer agrees with it, and no other
module of the package spells an HF MTP tensor name."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

import lightning_megatron
from lightning_megatron._compat.moe import _qwen3_moe_mtp_names
from lightning_megatron.families import (
    MODEL_FAMILIES,
    MOE_MODEL_TYPES,
    MTP_MODEL_TYPES,
    VL_MODEL_TYPES,
    checkpoint_mtp_layers,
    family,
    is_hf_mtp_tensor,
    mtp_names,
    text_model_config,
    with_text_model_fields,
)
from lightning_megatron.moe import checkpoint_num_experts
from lightning_megatron.mtp.restore import restore_mtp_head
from lightning_megatron.speculative.mtp_head import _detect_layout
from lightning_megatron.testing.checkpoints import FAMILIES, make_tiny_checkpoint
from lightning_megatron.testing.vl import VL_FAMILIES, make_tiny_vl_checkpoint

PACKAGE = Path(lightning_megatron.__file__).parent
# Each MTP family's checkpoint minus its MTP head is this one: the same decoder (MiMo is Qwen2 plus MTP layers).
BASE = {"qwen3": ("qwen3", False), "qwen3_moe": ("qwen3_moe", False), "mimo": ("qwen2", False),
        "glm4_moe": ("glm4_moe", False), "deepseek_v3": ("deepseek_v3", False),
        "qwen3_5_text": ("qwen3_5_text", False), "qwen3_5": ("qwen3_5", False),
        "qwen3_5_moe_text": ("qwen3_5_moe_text", False), "qwen3_5_moe": ("qwen3_5_moe", False)}


def _tensor_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as reader:
        return set(reader.keys())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("families")
    return {(name, mtp): make_tiny_checkpoint(root / f"{name}-{mtp}", name, mtp=mtp) for name, mtp in FAMILIES}


def test_every_tiny_family_is_in_the_table_with_its_architecture(tiny: dict) -> None:
    assert {name for name, _ in FAMILIES} | set(VL_FAMILIES) == set(MODEL_FAMILIES)
    assert set(VL_FAMILIES) == set(VL_MODEL_TYPES)
    assert {name for name, mtp in FAMILIES if mtp} == set(MTP_MODEL_TYPES)
    for (name, mtp), path in tiny.items():
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == [MODEL_FAMILIES[name].architecture]
        assert MODEL_FAMILIES[name].moe is (name in MOE_MODEL_TYPES) is (checkpoint_num_experts(config) > 0)
        assert checkpoint_mtp_layers(config) == int(mtp)
        if mtp:
            assert text_model_config(config)[mtp_names(name).layers_key] == 1


def test_a_multimodal_family_repeats_the_text_family_it_holds(tiny: dict) -> None:
    for name, entry in MODEL_FAMILIES.items():
        if entry.language_model is None:
            continue
        text = MODEL_FAMILIES[entry.language_model.model_type]
        assert (entry.mtp, entry.linear_attention, entry.moe) == (text.mtp, text.linear_attention, text.moe)
        config = json.loads((tiny[name, True] / "config.json").read_text())
        assert text_model_config(config)["model_type"] == text.model_type
        names = _tensor_names(tiny[name, True])
        assert {entry.language_model.text_name(tensor) for tensor in names} - {None} == _tensor_names(
            tiny[text.model_type, True])
        assert {entry.language_model.checkpoint_name(tensor) for tensor in _tensor_names(
            tiny[text.model_type, True])} == {tensor for tensor in names if entry.language_model.text_name(tensor)}


@pytest.mark.parametrize("name", VL_FAMILIES)
def test_vl_architectures_match_the_table(tmp_path: Path, name: str) -> None:
    path = make_tiny_vl_checkpoint(tmp_path / name, name, with_weights=False)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [MODEL_FAMILIES[name].architecture]
    assert config["model_type"] == name and MODEL_FAMILIES[name].vl_name


@pytest.mark.parametrize(("name", "mtp"), FAMILIES)
def test_is_hf_mtp_tensor_selects_exactly_the_mtp_head(tiny: dict, name: str, mtp: bool) -> None:
    names = _tensor_names(tiny[name, mtp])
    config = json.loads((tiny[name, mtp] / "config.json").read_text())
    selected = {tensor for tensor in names if is_hf_mtp_tensor(tensor, config)}
    if not mtp:
        assert not selected
        return
    assert names - selected == _tensor_names(tiny[BASE[name]])
    names_of = mtp_names(name)
    head, layer = set(names_of.head(0, config).values()), names_of.layer_prefix(0, config)
    assert head | set(names_of.copy_names(0, config).values()) <= selected
    assert all(tensor in head or tensor.startswith(layer) for tensor in selected)
    assert all(tensor.startswith(names_of.layer_prefixes(config)) for tensor in selected)
    if names_of.after_decoder:  # without the config, the MTP layer reads as one more decoder layer
        assert not any(is_hf_mtp_tensor(tensor) for tensor in names)


def test_layouts_after_the_decoder_need_the_config_to_name_a_tensor() -> None:
    names = mtp_names("glm4_moe")
    with pytest.raises(ValueError, match=r"pass the checkpoint's config \(num_hidden_layers\)"):
        names.head(0)
    assert names.head(0, {"num_hidden_layers": 46})["final_norm"] == "model.layers.46.shared_head.norm.weight"
    assert names.copy_names(0, {"num_hidden_layers": 46}) == {
        "model.embed_tokens.weight": "model.layers.46.embed_tokens.weight",
        "lm_head.weight": "model.layers.46.shared_head.head.weight"}


def test_a_tied_checkpoints_copy_of_the_lm_head_is_written_from_the_embedding() -> None:
    """A checkpoint with tied embeddings stores no `lm_head.weight`: its MTP layer's copy of it comes from the
    embedding (in an export, and in the names a delta weight sync sends after the embedding changed)."""
    names = mtp_names("deepseek_v3")
    untied = {"num_hidden_layers": 3, "tie_word_embeddings": False}
    assert names.copy_sources(0, untied) == {"model.layers.3.embed_tokens.weight": "model.embed_tokens.weight",
                                             "model.layers.3.shared_head.head.weight": "lm_head.weight"}
    assert set(names.copy_sources(0, {**untied, "tie_word_embeddings": True}).values()) == {
        "model.embed_tokens.weight"}


@pytest.mark.parametrize("name", MTP_MODEL_TYPES)
def test_the_restore_tool_writes_the_tables_names(tiny: dict, tmp_path: Path, name: str) -> None:
    source = tiny[name, True]
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    for entry in source.iterdir():
        if entry.name == "config.json":
            config = json.loads(entry.read_text())
            (stripped / entry.name).write_text(json.dumps(with_text_model_fields(config,
                                                                                 **{mtp_names(name).layers_key: 0})))
        elif entry.name != "model.safetensors":
            (stripped / entry.name).write_bytes(entry.read_bytes())
    from safetensors.torch import load_file, save_file

    save_file({k: v for k, v in load_file(source / "model.safetensors").items() if not is_hf_mtp_tensor(k, config)},
              stripped / "model.safetensors")
    restored = restore_mtp_head(stripped, tmp_path / "restored", init="random")
    assert _tensor_names(restored) == _tensor_names(source)


@pytest.mark.parametrize("name", MTP_MODEL_TYPES)
def test_the_speculative_decoder_finds_the_tables_layout(tiny: dict, name: str) -> None:
    config = json.loads((tiny[name, True] / "config.json").read_text())
    found, names = _detect_layout(tiny[name, True], _tensor_names(tiny[name, True]), config)
    assert names == mtp_names(name) and mtp_names(found) == names


def test_compat_qwen3_moe_mtp_mapping_names_exist_in_a_checkpoint(tiny: dict) -> None:
    hf_names = set(_qwen3_moe_mtp_names().values())
    assert hf_names <= _tensor_names(tiny["qwen3_moe", True])


def test_an_unknown_family_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"model_type: 'gpt2' .*qwen3, qwen2, llama, mimo"):
        family("gpt2")
    with pytest.raises(ValueError, match=r"model_type: 'llama' has no MTP head; .*qwen3, mimo, qwen3_moe"):
        mtp_names("llama")


# HF MTP tensor names (the table's spelling). Megatron's own MTP parameters (`mtp.layers.0.eh_proj.weight`,
# `mtp.layers.0.enorm.weight`, `mtp.layers.0.mtp_model_layer.*`, `mtp.layers.0.final_layernorm.weight`) match none.
HF_MTP_PATTERNS = [
    re.compile(pattern)
    for pattern in (
        r"\bmodel\.mtp_layers\b",  # MiMo's container
        r"\bmodel\.mtp\.",  # the nested layout is_hf_mtp_tensor also drops
        r"\bmtp\.(fc|norm)\b",  # Qwen3's projection and final norm
        r"pre_fc_norm_(embedding|hidden)",
        r"\b(token|hidden)_layernorm\b",  # MiMo's norms
        r"\binput_proj\b",
        r"\bmtp\.layers\.(\{i\}|\d+|\*)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)\b",  # HF sub-layer
        r"^\.?mtp\.(layers\.(\{i\}|\d+|\*)\.?)?$",  # a bare prefix or infix ("mtp.", ".mtp.", "mtp.layers.*")
        r"\bmodel\.layers\.(\{i\}|\d+|\*)\.(eh_proj|enorm|hnorm|embed_tokens)\b",  # GLM-4.5's MTP layer
        r"\bshared_head\.(norm|head)\b",
    )
]
# (file, literal): Megatron-side names that look like an HF prefix.
ALLOWED = {
    ("_compat/moe.py", "mtp."),  # mapping.megatron_param.startswith("mtp."): Megatron's GPTModel.mtp parameters
}


def _string_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant but documentation (a bare string statement: docstrings and attribute docstrings)."""
    documentation = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documentation]


def test_no_module_but_the_family_table_spells_an_hf_mtp_tensor_name() -> None:
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        relative = file.relative_to(PACKAGE).as_posix()
        if relative == "families.py":
            continue
        for line, literal in _string_literals(ast.parse(file.read_text(), str(file))):
            if (relative, literal) not in ALLOWED and any(pattern.search(literal) for pattern in HF_MTP_PATTERNS):
                found.append(f"{relative}:{line}: {literal!r}")
    assert not found, ("HF MTP names belong in lightning_megatron/families.py; read them from there:\n"
                       + "\n".join(found))


def test_the_scan_sees_the_spellings_it_guards_against() -> None:
    """The patterns flag each family's HF names and none of Megatron's, so the scan above can fail."""
    config = {"num_hidden_layers": 46}
    for name in MTP_MODEL_TYPES:
        head = mtp_names(name)
        spellings = [*head.head(0, config).values(), *head.copy_names(0, config).values()]
        if not head.after_decoder:  # an MTP layer stored as a decoder layer has a decoder layer's names
            spellings += [head.prefix, head.layer_prefix(0) + "input_layernorm.weight"]
        for spelled in spellings:
            assert any(pattern.search(spelled) for pattern in HF_MTP_PATTERNS), spelled
    megatron = ["mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
                "mtp.layers.0.final_layernorm.weight", "mtp.layers.*.mtp_model_layer",
                "mtp.layers.0.mtp_model_layer.input_layernorm.weight", "num_nextn_predict_layers", "mtp_loss"]
    assert not [name for name in megatron if any(pattern.search(name) for pattern in HF_MTP_PATTERNS)]
