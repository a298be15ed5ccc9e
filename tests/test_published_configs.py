"""Checkpoints in the config.json form they were published in (transformers 4's `rope_theta`, `rope_scaling`,
`partial_rotary_factor` at the top, `torch_dtype`, DeepSeek-V3's `auto_map`, ...: `testing.published`) build the
model their transformers-5 form builds, bit for bit, and the HF model; the package's own reads of config.json see
the same values in both forms; Qwen3's YaRN (added to config.json as its model cards say) is HF's; quantized
checkpoints (DeepSeek-V3's fp8) are refused before any build, naming the fix.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.families import checkpoint_mtp_layers, rope_parameters
from lightning_megatron.moe import checkpoint_num_experts, router_settings
from lightning_megatron.mtp.restore import MTPRestoreError, restore_mtp_head
from lightning_megatron.options import ModelOptions
from lightning_megatron.speculative.mtp_head import load_target
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from lightning_megatron.testing.published import PUBLISHED_FAMILIES
from lightning_megatron.testing.references import hf_mtp_reference_logits

SEQ = 12
FORMS = ("transformers5", "published")
DEEPSEEK = MoEShape(routed_scaling_factor=2.5, n_group=2, topk_group=1)
_MOE = {"deepseek_v3": DEEPSEEK, "glm4_moe": MoEShape(routed_scaling_factor=2.5)}
# Qwen3's long-context YaRN, as its model cards add it to config.json (rope_type, factor, original length only)
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each published family with its MTP head, in both config forms (the same tensors)."""
    root = tmp_path_factory.mktemp("published")
    return {(name, form): make_tiny_checkpoint(root / f"{name}-{form}", name, mtp=True, moe=_MOE.get(name),
                                               published=form == "published")
            for name in PUBLISHED_FAMILIES for form in FORMS}


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _input_ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _build_and_run(path: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Megatron's logits, MTP-head logits and model config (one process) for the checkpoint at `path`."""
    from megatron.core.utils import get_model_config

    chunk = create_bridge("megatron-bridge", path, trust_remote_code=_config(path)["model_type"] == "mimo").build(
        ModelOptions(mtp=True))[0].eval()
    captured = {}
    chunk.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))
    input_ids = _input_ids()
    with torch.no_grad():
        logits = chunk(input_ids=input_ids, position_ids=torch.arange(SEQ).expand_as(input_ids), attention_mask=None)
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        mtp_logits = chunk.output_layer(captured["hidden"][SEQ:], weight)[0].transpose(0, 1)[:, :-1]
    config = get_model_config(chunk)
    fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
    return logits, mtp_logits, {name: value for name, value in fields.items()
                                if name != "hf_model_id" and not callable(value)}  # functions: built per model


def _hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=_config(path)["model_type"] == "mimo")
    with torch.no_grad():
        return model(input_ids).logits


def test_the_published_forms_lay_the_config_out_as_published(checkpoints):
    """What a downloaded config.json has: DeepSeek-V3's YaRN under `rope_scaling` with `type`, GLM-4.5's rotary share
    at the top, `torch_dtype`; Qwen3.5's `text_config` keeps `rope_parameters` (with MRoPE sections)."""
    deepseek, glm = _config(checkpoints["deepseek_v3", "published"]), _config(checkpoints["glm4_moe", "published"])
    assert "rope_parameters" not in deepseek and deepseek["rope_scaling"]["type"] == "yarn"
    assert (deepseek["rope_theta"], deepseek["torch_dtype"], "auto_map" in deepseek) == (10000.0, "float32", True)
    assert (glm["partial_rotary_factor"], glm["rope_scaling"], "rope_parameters" in glm) == (0.5, None, False)
    qwen3_5 = _config(checkpoints["qwen3_5", "published"])["text_config"]
    assert qwen3_5["partial_rotary_factor"] == qwen3_5["rope_parameters"]["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("name", PUBLISHED_FAMILIES)
def test_the_packages_reads_of_config_json_are_the_same_in_both_forms(checkpoints, name):
    configs = [_config(checkpoints[name, form]) for form in FORMS]
    reads = [(rope_parameters(config) | {"type": None}, checkpoint_mtp_layers(config), checkpoint_num_experts(config),
              router_settings(config)) for config in configs]
    assert reads[0] == reads[1]
    assert reads[0][1] == 1 and reads[0][0]["rope_theta"] == 10000.0


@pytest.mark.parametrize("name", PUBLISHED_FAMILIES)
def test_both_forms_build_the_same_model_and_the_published_one_is_hfs(model_parallel, checkpoints, name):
    """Logits and MTP-head logits bit-identical across the forms, every model-config field equal (rotary share,
    YaRN, router, MTP layers); the published form's logits HF's, its MTP head the independent reference's (1e-5)."""
    published = checkpoints[name, "published"]
    logits, mtp_logits, config = _build_and_run(published)
    reference_logits, reference_mtp_logits, reference_config = _build_and_run(checkpoints[name, "transformers5"])
    assert torch.equal(logits, reference_logits) and torch.equal(mtp_logits, reference_mtp_logits)
    assert config == reference_config
    assert float((_hf_logits(published, _input_ids()) - logits).abs().max()) <= 1e-5
    if name != "qwen3_moe":  # the reference knows no Qwen3-MoE MTP layer (in either form)
        assert float((hf_mtp_reference_logits(published, _input_ids()) - mtp_logits).abs().max()) <= 1e-5


def test_a_published_deepseek_export_loads_in_transformers_and_its_head_restores_bit_for_bit(
        model_parallel, checkpoints, tmp_path):
    """DeepSeek-V3's form (`rope_scaling` with `type`, `auto_map` to its remote code): the export without MTP keeps the
    published config, transformers reads it without remote code, and the head restored from the download is the
    original's, bit for bit, through a build."""
    original = checkpoints["deepseek_v3", "published"]
    bridge = create_bridge("megatron-bridge", original)
    finetuned = bridge.save_hf(bridge.build(ModelOptions(mtp=False)), tmp_path / "finetuned")
    assert transformers.AutoConfig.from_pretrained(finetuned).rope_parameters["rope_type"] == "yarn"
    restored = restore_mtp_head(finetuned, tmp_path / "restored", source=original)
    assert _config(restored) == _config(original)
    bridge = create_bridge("megatron-bridge", restored)
    exported = load_file(bridge.save_hf(bridge.build(ModelOptions(mtp=True)), tmp_path / "exported")
                         / "model.safetensors")
    expected = load_file(original / "model.safetensors")
    assert exported.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(expected[name], exported[name])] == []


@pytest.mark.parametrize("published", [False, True])
def test_qwen3_yarn_is_hfs_through_megatron_bridge_and_refused_by_mbridge(model_parallel, tmp_path, published):
    """YaRN with transformers' defaults for the fields config.json leaves out (megatron-bridge leaves them None, a
    TypeError in the first forward); mbridge would interpolate linearly (logits off by O(1)), so it is refused."""
    path = make_tiny_checkpoint(tmp_path / "yarn", "qwen3", published=published,
                                config={"rope_parameters": QWEN3_YARN})
    if published:  # as the model card writes it: rope_type, beside the top-level rope_theta
        config = _config(path)
        assert config["rope_scaling"].pop("type") == "yarn"
        config["rope_scaling"]["rope_type"] = "yarn"
        (path / "config.json").write_text(json.dumps(config))
    chunk = create_bridge("megatron-bridge", path).build(ModelOptions())[0].eval()
    input_ids = _input_ids()
    with torch.no_grad():
        logits = chunk(input_ids=input_ids, position_ids=torch.arange(SEQ).expand_as(input_ids), attention_mask=None)
    hf = _hf_logits(path, input_ids)
    assert float((hf - logits).abs().max()) <= 1e-5
    plain = make_tiny_checkpoint(tmp_path / "plain", "qwen3")
    assert float((hf - _hf_logits(plain, input_ids)).abs().max()) > 1e-2  # YaRN changes this model's logits
    with pytest.raises(BridgeError, match=r"mbridge builds plain RoPE .*rope_type: 'yarn'.*set bridge_type: "
                                          r"megatron-bridge"):
        create_bridge("mbridge", path).validate(ModelOptions())


def _quantize_fp8(path: Path) -> None:
    """Rewrite a tiny DeepSeek-V3 checkpoint as DeepSeek publishes its weights: every projection float8_e4m3fn with a
    `weight_scale_inv` (one scale per 128x128 block: here one block), config.json's `quantization_config`."""
    quantized = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.endswith("proj.weight"):
            scale = tensor.abs().max() / torch.finfo(torch.float8_e4m3fn).max
            quantized[name] = (tensor / scale).to(torch.float8_e4m3fn)
            quantized[name.removesuffix("weight") + "weight_scale_inv"] = scale.reshape(1, 1)
        else:
            quantized[name] = tensor
    save_file(quantized, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = _config(path)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))


def test_an_fp8_deepseek_checkpoint_is_refused_naming_the_bf16_conversion(model_parallel, tmp_path):
    """Training, the MTP restore (which would copy e4m3 values without their scales) and the speculative evaluator
    all refuse it before reading a weight."""
    fp8 = make_tiny_checkpoint(tmp_path / "fp8", "deepseek_v3", mtp=True, moe=DEEPSEEK, published=True)
    _quantize_fp8(fp8)
    refusal = r"declares quantization_config \(quant_method: 'fp8'\).*fp8_cast_bf16\.py.*delete quantization_config"
    with pytest.raises(BridgeError, match=rf"hf_checkpoint: {fp8}: config.json {refusal}"):
        create_bridge("megatron-bridge", fp8).validate(ModelOptions(mtp=True))
    plain = make_tiny_checkpoint(tmp_path / "plain", "deepseek_v3", moe=DEEPSEEK)
    with pytest.raises(MTPRestoreError, match=rf"source: {fp8}: config.json {refusal}"):
        restore_mtp_head(plain, tmp_path / "restored", source=fp8)
    with pytest.raises(ValueError, match=rf"checkpoint: {fp8}: config.json {refusal}"):
        load_target(fp8)
