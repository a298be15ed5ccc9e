"""The tiny-checkpoint factory every other test builds on: deterministic, loadable by transformers, exact MTP keys,
a working tokenizer, and an MTP reference that really depends on the MTP weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_megatron.families import (
    LANGUAGE_MODEL_TYPES,
    MODEL_FAMILIES,
    checkpoint_mtp_layers,
    is_hf_mtp_tensor,
    mtp_names,
    text_model_config,
)
from lightning_megatron.testing.checkpoints import FAMILIES, make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits

_LAYER = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
# Spelled out from megatron-bridge 0.6.2's qwen3_bridge.py / mimo_bridge.py mappings.
QWEN3_MTP_KEYS = {
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    *(f"mtp.layers.0.{name}" for name in _LAYER),
    "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight",
}
MIMO_MTP_KEYS = {
    "model.mtp_layers.0.token_layernorm.weight",
    "model.mtp_layers.0.hidden_layernorm.weight",
    "model.mtp_layers.0.input_proj.weight",
    "model.mtp_layers.0.final_layernorm.weight",
    *(f"model.mtp_layers.0.{name}" for name in _LAYER),
    "model.mtp_layers.0.self_attn.q_proj.bias",
    "model.mtp_layers.0.self_attn.k_proj.bias",
    "model.mtp_layers.0.self_attn.v_proj.bias",
}
# Qwen3-MoE's MTP layer (Qwen3-Next's layout): a router and 4 experts in place of the dense MLP.
QWEN3_MOE_MTP_KEYS = {name for name in QWEN3_MTP_KEYS if ".mlp." not in name} | {
    "mtp.layers.0.mlp.gate.weight",
    *(f"mtp.layers.0.mlp.experts.{expert}.{projection}_proj.weight"
      for expert in range(4) for projection in ("gate", "up", "down")),
}
# GLM-4.5's MTP layer (decoder layer num_hidden_layers = 2 here), spelled out from megatron-bridge 0.6.2's
# glm/glm45_bridge.py mappings, plus the copies of the embedding and LM head GLM-4.5-Air's index lists.
GLM4_MOE_MTP_KEYS = {
    *(f"model.layers.2.{name}" for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                                            "embed_tokens.weight", "shared_head.head.weight", "input_layernorm.weight",
                                            "post_attention_layernorm.weight", "mlp.gate.weight",
                                            "mlp.gate.e_score_correction_bias")),
    *(f"model.layers.2.self_attn.{proj}_proj.{kind}" for proj in "qkv" for kind in ("weight", "bias")),
    "model.layers.2.self_attn.o_proj.weight",
    *(f"model.layers.2.mlp.shared_experts.{projection}_proj.weight" for projection in ("gate", "up", "down")),
    *(f"model.layers.2.mlp.experts.{expert}.{projection}_proj.weight"
      for expert in range(4) for projection in ("gate", "up", "down")),
}
# DeepSeek-V3's MTP layer: GLM-4.5's layout with multi-head latent attention (megatron-bridge 0.6.2's
# deepseek/common.py mappings, and the copies DeepSeek-V3's index lists as model.layers.61.*).
DEEPSEEK_V3_MTP_KEYS = {name for name in GLM4_MOE_MTP_KEYS if ".self_attn." not in name} | {
    f"model.layers.2.self_attn.{name}.weight" for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                          "kv_a_layernorm", "kv_b_proj", "o_proj")}
# Qwen3.5-MoE's MTP layer (megatron-bridge 0.6.2's qwen/qwen35_bridge.py MTP mappings, Qwen3.5-35B-A3B's index):
# Qwen3-MoE's, its experts one by one, plus a shared expert and its sigmoid gate.
QWEN3_5_MOE_MTP_KEYS = QWEN3_MOE_MTP_KEYS | {"mtp.layers.0.mlp.shared_expert_gate.weight", *(
    f"mtp.layers.0.mlp.shared_expert.{projection}_proj.weight" for projection in ("gate", "up", "down"))}
IDS = torch.tensor([[5, 17, 42, 99, 200, 301, 7, 64], [300, 3, 3, 150, 11, 12, 250, 383]])


def _mtp_keys(family: str, mtp: bool) -> set[str]:
    return {("qwen3", True): QWEN3_MTP_KEYS, ("mimo", True): MIMO_MTP_KEYS,
            ("qwen3_moe", True): QWEN3_MOE_MTP_KEYS,  # GLM-4.5's names have no "mtp"
            ("qwen3_5_text", True): QWEN3_MTP_KEYS, ("qwen3_5", True): QWEN3_MTP_KEYS,
            ("qwen3_5_moe_text", True): QWEN3_5_MOE_MTP_KEYS,
            ("qwen3_5_moe", True): QWEN3_5_MOE_MTP_KEYS}.get((family, mtp), set())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, bool], Path]:
    """One checkpoint per (family, mtp, tied), shared by the tests that only read them."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        (family, mtp, tied): make_tiny_checkpoint(root / f"{family}-{mtp}-{tied}", family, mtp=mtp, tied=tied)
        for family, mtp in FAMILIES
        for tied in (False, True)
    }


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    first = make_tiny_checkpoint(tmp_path / "a", "mimo", mtp=True, seed=3)
    second = make_tiny_checkpoint(tmp_path / "b", "mimo", mtp=True, seed=3)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    required = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert required | {"configuration_mimo.py", "modeling_mimo.py"} == set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other_seed = make_tiny_checkpoint(tmp_path / "c", "mimo", mtp=True, seed=4)
    assert (other_seed / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert (other_seed / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_rewrite_replaces_in_place_and_leaves_no_temporaries(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    assert make_tiny_checkpoint(path, "qwen2", tied=True) == path
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_mtp_weights_are_added_without_changing_the_base_model(checkpoints: dict) -> None:
    plain = load_file(checkpoints["qwen3", False, False] / "model.safetensors")
    with_mtp = load_file(checkpoints["qwen3", True, False] / "model.safetensors")
    assert set(with_mtp) - set(plain) == QWEN3_MTP_KEYS
    assert all(torch.equal(plain[name], with_mtp[name]) for name in plain)


@pytest.mark.parametrize(("family", "mtp"), FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_loads_in_transformers_and_runs(checkpoints: dict, family: str, mtp: bool, tied: bool) -> None:
    path = checkpoints[family, mtp, tied]
    config = json.loads((path / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=family == "mimo", output_loading_info=True
    )
    # a multimodal checkpoint loads as its text model (transformers' own reading, which the package's follows)
    layout = MODEL_FAMILIES[family].language_model
    assert type(model).__name__ == MODEL_FAMILIES[layout.model_type if layout else family].architecture
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # Qwen3ForCausalLM has no MTP module: it skips exactly the MTP tensors. MiMo's remote code loads everything.
    expected_unexpected = QWEN3_MTP_KEYS if (family, mtp) == ("qwen3", True) else set()
    if family in ("qwen3_moe", "glm4_moe", "deepseek_v3"):  # transformers names the MTP experts it skips fused
        prefix = "mtp." if family == "qwen3_moe" else "model.layers.2."
        assert bool(info["unexpected_keys"]) is mtp and all(key.startswith(prefix) for key in info["unexpected_keys"])
    else:
        assert set(info["unexpected_keys"]) == expected_unexpected
    layers_key = "mtp_num_hidden_layers" if family.startswith("qwen3_5") else "num_nextn_predict_layers"
    assert text_model_config(config).get(layers_key) == (1 if mtp else None)
    assert model.config.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    with torch.no_grad():
        logits = model(IDS).logits
    assert logits.shape == (*IDS.shape, 384)
    assert torch.isfinite(logits).all() and logits.std() > 0.1


@pytest.mark.parametrize(("family", "mtp"), FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_tensor_names(checkpoints: dict, family: str, mtp: bool, tied: bool) -> None:
    names = set(load_file(checkpoints[family, mtp, tied] / "model.safetensors"))
    layout = MODEL_FAMILIES[family].language_model
    if layout is not None:  # the text model's names, the vision tower's apart
        assert any(name.startswith(layout.other_prefixes) for name in names)
        names = {layout.text_name(name) for name in names} - {None}
    assert ("lm_head.weight" in names) is not tied
    assert {n for n in names if "mtp" in n} == _mtp_keys(family, mtp)
    has_bias = family in ("qwen2", "mimo", "qwen2_moe", "glm4_moe")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) is has_bias
    assert ("model.layers.1.self_attn.q_norm.weight" in names) is (
        family in ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"))
    is_moe = family in ("qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3")
    assert ("model.layers.1.mlp.experts.3.down_proj.weight" in names) is is_moe
    assert ("model.layers.1.mlp.experts.gate_up_proj" in names) is (family in ("qwen3_5_moe_text", "qwen3_5_moe"))
    assert ("model.layers.1.mlp.shared_expert_gate.weight" in names) is (
        family in ("qwen2_moe", "qwen3_5_moe_text", "qwen3_5_moe"))
    assert ("model.layers.0.mlp.experts.0.up_proj.weight" in names) is (family in ("qwen3_moe", "qwen2_moe"))
    assert ({name for name in names if name.startswith("model.layers.2.")} == GLM4_MOE_MTP_KEYS) is (
        family == "glm4_moe" and mtp)
    assert ({name for name in names if name.startswith("model.layers.2.")} == DEEPSEEK_V3_MTP_KEYS) is (
        family == "deepseek_v3" and mtp)
    assert ("model.layers.0.self_attn.kv_b_proj.weight" in names) is (family == "deepseek_v3")


@pytest.mark.parametrize("family", LANGUAGE_MODEL_TYPES)
def test_the_multimodal_qwen3_5_checkpoint_is_the_text_one_with_a_vision_tower(checkpoints: dict, family: str) -> None:
    """Its HF class (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration) loads every tensor but the
    MTP head (which transformers skips), and on text its logits are those of the text checkpoint of the same seed."""
    import transformers

    model_class = getattr(transformers, MODEL_FAMILIES[family].architecture)
    model, info = model_class.from_pretrained(checkpoints[family, True, False], output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"]
    text = AutoModelForCausalLM.from_pretrained(
        checkpoints[MODEL_FAMILIES[family].language_model.model_type, True, False])
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, text(IDS).logits)


def test_glm4_moe_copies_the_embedding_and_lm_head_into_its_mtp_layer(checkpoints: dict) -> None:
    tensors = load_file(checkpoints["glm4_moe", True, False] / "model.safetensors")
    assert torch.equal(tensors["model.layers.2.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors["model.layers.2.shared_head.head.weight"], tensors["lm_head.weight"])
    plain = load_file(checkpoints["glm4_moe", False, False] / "model.safetensors")
    assert all(torch.equal(plain[name], tensors[name]) for name in plain)
    config = json.loads((checkpoints["glm4_moe", True, False] / "config.json").read_text())
    assert (config["first_k_dense_replace"], config["n_shared_experts"], config["partial_rotary_factor"]) == (1, 1, 0.5)


def test_dtype_and_sizes_follow_the_arguments(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(
        tmp_path / "big", "qwen3", mtp=True, dtype=torch.bfloat16, num_layers=3, hidden_size=96, vocab_size=1024
    )
    tensors = load_file(path / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert tensors["model.embed_tokens.weight"].shape == (1024, 96)
    assert tensors["mtp.fc.weight"].shape == (96, 192)
    assert "model.layers.2.mlp.down_proj.weight" in tensors
    config = json.loads((path / "config.json").read_text())
    assert (config["dtype"], config["num_hidden_layers"], config["head_dim"]) == ("bfloat16", 3, 24)
    assert len(AutoTokenizer.from_pretrained(path)) == 1024


@pytest.mark.parametrize(("family", "mtp"), [("mimo", False), ("llama", True), ("qwen2", True)])
def test_unsupported_combinations_are_refused(tmp_path: Path, family: str, mtp: bool) -> None:
    with pytest.raises(ValueError, match="unsupported"):
        make_tiny_checkpoint(tmp_path / "x", family, mtp=mtp)
    assert not any(tmp_path.iterdir())


def test_tokenizer_round_trips_and_applies_the_chat_template(checkpoints: dict) -> None:
    path = checkpoints["qwen3", False, False]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 384
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == tokenizer.eos_token_id
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    for text in [
        "The quick brown fox.",
        "def f(x):\n\treturn x ** 2  # square\n\n",
        "Ünïcödé 你好 🎉 and  double  spaces\r\n",
        "<|im_start|>user\nraw specials<|im_end|>",
        "",
    ]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    encoded = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "Hello!<|im_end|>"


@pytest.mark.parametrize("family", ["qwen3", "mimo", "glm4_moe", "deepseek_v3"])
def test_mtp_reference_logits_shape_causality_and_sensitivity(checkpoints: dict, tmp_path: Path, family: str) -> None:
    path = checkpoints[family, True, False]
    logits = hf_mtp_reference_logits(path, IDS)
    assert logits.shape == (2, IDS.shape[1] - 1, 384) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()

    # Position t sees tokens up to t+1 only.
    changed_last = IDS.clone()
    changed_last[:, -1] = 9
    other = hf_mtp_reference_logits(path, changed_last)
    # (routed experts: the changed token reaches other experts, whose matrix products over another number of tokens
    # may round differently in float32, ~1e-7 here)
    unchanged = (other[:, :-1] - logits[:, :-1]).abs().max()
    assert (unchanged <= 1e-5 if family in ("glm4_moe", "deepseek_v3") else unchanged == 0)
    assert not torch.allclose(other[:, -1], logits[:, -1])

    # Every part of the MTP head matters, including which half of the projection sees the hidden state.
    prefix = {"qwen3": "mtp.", "mimo": "model.mtp_layers.0.", "glm4_moe": "model.layers.2.",
              "deepseek_v3": "model.layers.2."}[family]
    proj, enorm, hnorm, final = {
        "qwen3": ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"),
        "mimo": ("input_proj", "token_layernorm", "hidden_layernorm", "final_layernorm"),
        "glm4_moe": ("eh_proj", "enorm", "hnorm", "shared_head.norm"),
        "deepseek_v3": ("eh_proj", "enorm", "hnorm", "shared_head.norm"),
    }[family]
    layer = "layers.0." if family == "qwen3" else ""
    tensors = load_file(path / "model.safetensors")
    edits = {
        f"{prefix}{enorm}.weight": lambda t: t * 1.5,
        f"{prefix}{hnorm}.weight": lambda t: t * 1.5,
        f"{prefix}{final}.weight": lambda t: t.flip(0),
        f"{prefix}{layer}self_attn.o_proj.weight": lambda t: t * 2,
        f"{prefix}{proj}.weight": lambda t: torch.cat(t.chunk(2, dim=1)[::-1], dim=1),
    }
    if family in ("glm4_moe", "deepseek_v3"):  # the routed experts, the shared expert and the expert bias
        edits.update({f"{prefix}mlp.shared_experts.down_proj.weight": lambda t: -t,
                      f"{prefix}mlp.gate.e_score_correction_bias": lambda t: -t})
    else:
        edits[f"{prefix}{layer}mlp.down_proj.weight"] = lambda t: -t
    edited = tmp_path / "edited"
    shutil.copytree(path, edited)
    for name, edit in edits.items():
        save_file({**tensors, name: edit(tensors[name])}, edited / "model.safetensors", metadata={"format": "pt"})
        assert (hf_mtp_reference_logits(edited, IDS) - logits).abs().max() > 1e-2, name
    if family in ("glm4_moe", "deepseek_v3"):  # the routed experts, together (the bias keeps some from every token)
        experts = {name: -t for name, t in tensors.items() if name.startswith(f"{prefix}mlp.experts.")}
        save_file({**tensors, **experts}, edited / "model.safetensors", metadata={"format": "pt"})
        assert (hf_mtp_reference_logits(edited, IDS) - logits).abs().max() > 1e-2


def test_mtp_reference_refuses_checkpoints_without_mtp(checkpoints: dict) -> None:
    with pytest.raises(ValueError, match="no MTP weights"):
        hf_mtp_reference_logits(checkpoints["qwen3", False, False], IDS)


def test_attention_and_ffn_shapes_follow_the_arguments(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(
        tmp_path / "shaped", "qwen3", mtp=True, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
        intermediate_size=80, max_position_embeddings=1024,
    )
    tensors = load_file(path / "model.safetensors")
    for prefix in ("model.layers.1.", "mtp.layers.0."):
        assert tensors[f"{prefix}self_attn.q_proj.weight"].shape == (96, 64)
        assert tensors[f"{prefix}self_attn.k_proj.weight"].shape == (24, 64)
        assert tensors[f"{prefix}self_attn.o_proj.weight"].shape == (64, 96)
        assert tensors[f"{prefix}self_attn.q_norm.weight"].shape == (12,)
        assert tensors[f"{prefix}mlp.down_proj.weight"].shape == (64, 80)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 2, 12)
    assert (config["intermediate_size"], config["max_position_embeddings"]) == (80, 1024)
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == 1024
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


@pytest.mark.parametrize(
    ("family", "kwargs", "match"),
    [
        ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 4}, "multiple of num_key_value_heads"),
        ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 2}, "pass head_dim explicitly"),
        ("qwen3", {"head_dim": 7}, "even"),
        ("qwen2", {"head_dim": 32}, "no head_dim field"),
    ],
)
def test_inconsistent_shapes_are_refused(tmp_path: Path, family: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_tiny_checkpoint(tmp_path / "x", family, **kwargs)
    assert not any(tmp_path.iterdir())


def _plain_tokenizer() -> Tokenizer:
    """A word-level tokenizer without ChatML: its specials are <pad> (id 0) and </s> (id 1)."""
    vocab = {"<pad>": 0, "</s>": 1, "[UNK]": 2, **{word: i + 3 for i, word in enumerate("the quick brown fox".split())}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["</s>", "<pad>"])
    return tokenizer


def test_a_given_tokenizer_without_chatml_is_written_with_its_first_special_token(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "custom", "qwen3", vocab_size=300, tokenizer=_plain_tokenizer())
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 7 and tokenizer.encode("the fox") == [3, 6]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<pad>", "<pad>") and tokenizer.chat_template is None
    config = json.loads((path / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["bos_token_id"]) == (300, 0, 0)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 0
    assert load_file(path / "model.safetensors")["model.embed_tokens.weight"].shape == (300, 64)

    with pytest.raises(ValueError, match="pass vocab_size >= 7"):
        make_tiny_checkpoint(tmp_path / "small", "qwen3", vocab_size=6, tokenizer=_plain_tokenizer())
    no_specials = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="special token"):
        make_tiny_checkpoint(tmp_path / "none", "qwen3", tokenizer=no_specials)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["custom"]


def test_a_given_chatml_tokenizer_gives_the_same_files_as_the_built_in_one(tmp_path: Path) -> None:
    default = make_tiny_checkpoint(tmp_path / "default", "qwen3", vocab_size=512)
    given = make_tiny_checkpoint(
        tmp_path / "given", "qwen3", vocab_size=512, tokenizer=Tokenizer.from_file(str(default / "tokenizer.json"))
    )
    for name in sorted(p.name for p in default.iterdir()):
        assert (default / name).read_bytes() == (given / name).read_bytes(), name


def test_a_qwen3_vocabulary_is_filled_with_reserved_tokens(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "big-vocab", "qwen3", num_layers=1, hidden_size=16, vocab_size=151936)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 151936
    assert tokenizer.id_to_token(151935).startswith("<|reserved_")
    assert load_file(path / "model.safetensors")["model.embed_tokens.weight"].shape == (151936, 16)


def test_qwen3_5_interleaves_gated_deltanet_and_gated_attention_as_its_checkpoints_do(checkpoints: dict) -> None:
    """Qwen3.5-0.8B's tensor names, at the tiny sizes: layer 0 gated DeltaNet, layer 1 gated full attention (q_proj
    twice the query size: queries and output gates), the MTP layer full attention; zero-centred norms near 0."""
    path = checkpoints["qwen3_5_text", True, False]
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    linear = {name.removeprefix("model.layers.0.linear_attn."): tuple(tensor.shape) for name, tensor in tensors.items()
              if name.startswith("model.layers.0.linear_attn.")}
    assert linear == {"in_proj_qkv.weight": (128, 64), "in_proj_z.weight": (64, 64), "in_proj_b.weight": (4, 64),
                      "in_proj_a.weight": (4, 64), "conv1d.weight": (128, 1, 4), "dt_bias": (4,), "A_log": (4,),
                      "norm.weight": (16,), "out_proj.weight": (64, 64)}
    assert not any(name.startswith("model.layers.0.self_attn.") for name in tensors)
    for prefix in ("model.layers.1.", "mtp.layers.0."):
        assert tensors[f"{prefix}self_attn.q_proj.weight"].shape == (2 * 64, 64)
        assert tensors[f"{prefix}self_attn.o_proj.weight"].shape == (64, 64)
    assert tensors["mtp.fc.weight"].shape == (64, 128)
    assert tensors["model.norm.weight"].abs().mean() < 0.2  # scale 1 + weight
    assert (tensors["model.layers.0.linear_attn.norm.weight"] - 1).abs().mean() < 0.2  # scale weight


def test_qwen3_5_moe_packs_its_decoder_experts_but_not_its_mtp_layers(checkpoints: dict) -> None:
    """Qwen3.5-35B-A3B's layout at the tiny sizes: each decoder layer's experts packed (gate rows first, as
    transformers' Qwen3_5MoeExperts holds them), the MTP layer's one by one, both with a gated shared expert."""
    path = checkpoints["qwen3_5_moe_text", True, False]
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert (config["num_experts"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (
        4, 32, 64)
    for layer in (0, 1):
        experts = f"model.layers.{layer}.mlp.experts."
        assert tensors[experts + "gate_up_proj"].shape == (4, 2 * 32, 64)
        assert tensors[experts + "down_proj"].shape == (4, 64, 32)
        assert not any(name.startswith(experts + "0.") for name in tensors)
        assert tensors[f"model.layers.{layer}.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert tensors["mtp.layers.0.mlp.experts.3.gate_proj.weight"].shape == (32, 64)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" not in tensors
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in tensors
    assert tensors["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * 64, 64)  # queries and output gates


CONFIG_VARIATIONS = {  # (family, make_tiny_checkpoint arguments): the published checkpoints' variations
    "qwen3_5-0.8b": ("qwen3_5", dict(tied=True, num_layers=4, head_dim=32, config=dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8))),
    "qwen3_5_moe-35b": ("qwen3_5_moe_text", dict(config=dict(linear_num_key_heads=2, linear_num_value_heads=4,
                                                             linear_key_head_dim=8, linear_value_head_dim=12))),
    "glm-4.6": ("glm4_moe", dict(head_dim=32, config=dict(use_qk_norm=True, num_nextn_predict_layers=2))),
    "moonlight": ("deepseek_v3", dict(config=dict(q_lora_rank=None, n_shared_experts=2,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 5e4}))),
}


@pytest.mark.parametrize("variation", CONFIG_VARIATIONS)
def test_config_variations_load_in_transformers_with_every_tensor(tmp_path: Path, variation: str) -> None:
    """`make_tiny_checkpoint(config=...)`: the tensors follow the varied fields (transformers loads every tensor of
    the main model, misses none) and MTP layers are written as many as declared."""
    family, arguments = CONFIG_VARIATIONS[variation]
    path = make_tiny_checkpoint(tmp_path / variation, family, mtp=True, **arguments)
    config = text_model_config(json.loads((path / "config.json").read_text()))
    for key, value in arguments["config"].items():
        assert config.get(key, config["rope_parameters"].get(key)) == value, key
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    names = set(load_file(path / "model.safetensors"))
    assert all(is_hf_mtp_tensor(name, config) or name.startswith("model.visual.") for name in info["unexpected_keys"])
    assert {name for name in names if is_hf_mtp_tensor(name, config)} >= {
        mtp_names(family).head(i, config)["projection"] for i in range(checkpoint_mtp_layers(config))}
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


def test_config_variations_refuse_fields_the_maker_does_not_vary(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config: \['hidden_act'\] are not fields make_tiny_checkpoint varies"):
        make_tiny_checkpoint(tmp_path / "a", "glm4_moe", config={"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="an MTP layer count needs mtp=True"):
        make_tiny_checkpoint(tmp_path / "b", "glm4_moe", config={"num_nextn_predict_layers": 2})
