"""Each no-TE bridge adjustment: the bridge fails here without it, and the path it unblocks works with it.

Models are tiny HF checkpoints built through megatron-bridge or mbridge exactly as the strategy will, and their
logits are checked against Hugging Face's (the MTP head against `hf_mtp_reference_logits`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_megatron import _compat
from lightning_megatron._compat import cpu, no_te
from lightning_megatron._compat import mbridge as mbridge_adjustments
from lightning_megatron.testing.checkpoints import Family, make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="the adjustments apply only without TE"
)

ADJUSTMENTS = {
    adjustment.name: adjustment for adjustment in (*no_te.MEGATRON_BRIDGE_ADJUSTMENTS, *mbridge_adjustments.ADJUSTMENTS)
}
SEQ = 8


@pytest.fixture(scope="module")
def parallel_state_1x1(process_group: None) -> Iterator[None]:
    """TP=PP=1 for the whole module: mbridge reads the parallel state when a bridge is created."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():  # kept: Megatron never frees its process groups
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    yield


@pytest.fixture(scope="module")
def megatron_bridge(parallel_state_1x1: None) -> ModuleType:
    return _compat.import_megatron_bridge()


@pytest.fixture(scope="module")
def mbridge(parallel_state_1x1: None) -> ModuleType:
    return _compat.import_mbridge()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`checkpoint(family, mtp=False, tied=False)`: a tiny HF checkpoint, written once per module."""
    made: dict[tuple[Family, bool, bool], Path] = {}

    def get(family: Family, mtp: bool = False, tied: bool = False) -> Path:
        if (family, mtp, tied) not in made:
            directory = tmp_path_factory.mktemp(f"{family}_mtp{mtp}_tied{tied}")
            made[family, mtp, tied] = make_tiny_checkpoint(directory, family, mtp=mtp, tied=tied)
        return made[family, mtp, tied]

    return get


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)


def _assert_matches_hf(model: torch.nn.Module, path: Path, input_ids: torch.Tensor) -> None:
    torch.testing.assert_close(_logits(model, input_ids), _hf_logits(path, input_ids), atol=1e-5, rtol=1e-5)


def _megatron_bridge_model(megatron_bridge: ModuleType, path: Path, **provider_settings: Any) -> torch.nn.Module:
    """The verified CPU recipe: provider with the HF-load hook, fp32, no wrapper."""
    provider = megatron_bridge.AutoBridge.from_hf_pretrained(path).to_megatron_provider(load_weights=True)
    for name, value in {"params_dtype": torch.float32, "bf16": False, **provider_settings}.items():
        setattr(provider, name, value)
    provider.finalize()
    (model,) = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, bf16=False, fp16=False, mixed_precision_wrapper=None
    )
    return model


def _mbridge_model(mbridge: ModuleType, path: Path) -> torch.nn.Module:
    """Without the recipe's `use_torch_fsdp2=True`: on CPU, `cpu.cuda_tensors` makes get_model's `.cuda()` a no-op."""
    bridge = mbridge.AutoBridge.from_pretrained(str(path), dtype=torch.float32)
    (model,) = bridge.get_model(wrap_with_ddp=False, bf16=False, fp16=False, use_cpu_initialization=True)
    bridge.load_weights([model], str(path))
    return model


def _raised_in(excinfo: pytest.ExceptionInfo, function: str, file: str = "") -> bool:
    return any(entry.name == function and str(entry.path).endswith(file) for entry in excinfo.traceback)


# megatron-bridge ------------------------------------------------------------------------------------------------


def test_megatron_bridge_import_fails_without_adjustment() -> None:
    command = [sys.executable, "-c", "import megatron.bridge"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "ModuleNotFoundError: No module named 'transformer_engine'" in result.stderr
    assert "megatron/bridge/peft/lora_layers.py" in result.stderr


def test_megatron_training_root_logger_level() -> None:
    """In a process that configured no logging: upstream's import turns the root logger to INFO, ours leaves it."""
    code = textwrap.dedent("""
        import logging, sys
        import megatron.training.training
        upstream = logging.getLogger().level
        root = logging.getLogger()  # back to an unconfigured process, and the module imported anew below
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        del sys.modules["megatron.training.training"]
        from lightning_megatron._compat import import_megatron_bridge, root_logger
        import_megatron_bridge()
        print(upstream, root.level, root_logger.ADJUSTMENTS[0].active)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.split() == ["20", "30", "True"], result.stderr[-2000:]


def test_megatron_bridge_imports_without_transformer_engine_in_sys_modules(megatron_bridge: ModuleType) -> None:
    from megatron.bridge.peft import lora_layers
    from megatron.core.extensions import transformer_engine as mcore_te

    assert ADJUSTMENTS["megatron_bridge.lora_layers_import"].active
    assert "transformer_engine" not in sys.modules
    assert importlib.util.find_spec("transformer_engine") is None
    assert mcore_te.HAVE_TE is False  # megatron-core still sees no TE
    assert not isinstance(torch.nn.Linear(2, 2), (lora_layers.te.Linear, lora_layers.te.LayerNormLinear))
    with pytest.raises(ModuleNotFoundError, match="needs Transformer Engine"):
        lora_layers.te.ops.Sequential()


def test_megatron_bridge_quiet_missing_te_imports(megatron_bridge: ModuleType, caplog) -> None:
    from megatron.bridge.utils.import_utils import safe_import_from

    def reports() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron.bridge.utils.import_utils"):
            _, found = safe_import_from("megatron.core.extensions.transformer_engine", "FP8GlobalStateManager")
        assert not found
        return [record.getMessage() for record in caplog.records]

    with ADJUSTMENTS["megatron_bridge.quiet_missing_te_imports"].suspended():
        (upstream,) = reports()
    assert upstream.startswith("Import of FP8GlobalStateManager from megatron.core.extensions.transformer_engine "
                               "failed with: Traceback")
    assert reports() == []


@pytest.mark.parametrize(
    ("lora_kwargs", "failing_function"),
    [
        ({}, "get_adapter_attributes_from_linear"),  # named target modules: peft/utils.py:591
        ({"target_modules": [], "exclude_modules": ["linear_fc2"]}, "match"),  # every linear: module_matcher.py:160
    ],
    ids=["target_modules", "exclude_modules"],
)
def test_megatron_bridge_peft_have_te(
    megatron_bridge: ModuleType, checkpoint, input_ids, lora_kwargs: dict, failing_function: str
) -> None:
    from megatron.bridge.peft.lora import LoRA

    path = checkpoint("qwen3")
    with ADJUSTMENTS["megatron_bridge.peft_have_te"].suspended():
        with pytest.raises(TypeError, match=r"isinstance\(\) arg 2 must be a type") as excinfo:
            LoRA(dim=4, alpha=8, **lora_kwargs)([_megatron_bridge_model(megatron_bridge, path)], training=True)
        assert _raised_in(excinfo, failing_function)

    (model,) = LoRA(dim=4, alpha=8, **lora_kwargs)([_megatron_bridge_model(megatron_bridge, path)], training=True)
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert trainable and all(".adapter.linear_" in name for name in trainable)
    _assert_matches_hf(model, path, input_ids)  # the LoRA up-projections start at zero


def test_megatron_bridge_local_layer_spec(megatron_bridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint("qwen3")
    with ADJUSTMENTS["megatron_bridge.local_layer_spec"].suspended():
        with pytest.raises(TypeError, match="'NoneType' object is not callable") as excinfo:
            _megatron_bridge_model(megatron_bridge, path)
        assert _raised_in(excinfo, "get_gpt_layer_with_transformer_engine_submodules")

    _assert_matches_hf(_megatron_bridge_model(megatron_bridge, path), path, input_ids)


def test_megatron_bridge_llama_local_fusions(megatron_bridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint("llama")
    with ADJUSTMENTS["megatron_bridge.llama_local_fusions"].suspended():
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):  # transformer_config.py:2185
            _megatron_bridge_model(megatron_bridge, path)
        with pytest.raises(AssertionError, match="persist_layer_norm not supported by torch LayerNorm"):
            _megatron_bridge_model(megatron_bridge, path, apply_rope_fusion=False)  # then torch_norm.py:48

    _assert_matches_hf(_megatron_bridge_model(megatron_bridge, path), path, input_ids)


def _mtp_head_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits: Megatron appends its hidden states after the main ones ([2S, B, H] for one layer)."""
    captured = {}
    hook = model.mtp.register_forward_hook(lambda module, args, output: captured.setdefault("hidden", output))
    try:
        _logits(model, input_ids)
    finally:
        hook.remove()
    mtp_hidden = captured["hidden"][SEQ : 2 * SEQ].transpose(0, 1)
    return mtp_hidden @ model.output_layer.weight.T


def test_megatron_bridge_local_mtp_block_spec(megatron_bridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint("qwen3", mtp=True)
    with ADJUSTMENTS["megatron_bridge.local_mtp_block_spec"].suspended():
        with pytest.raises(TypeError, match="'NoneType' object is not callable") as excinfo:
            _megatron_bridge_model(megatron_bridge, path)
        assert _raised_in(excinfo, "mtp_block_spec")

    model = _megatron_bridge_model(megatron_bridge, path)
    _assert_matches_hf(model, path, input_ids)
    mtp_logits = _mtp_head_logits(model, input_ids)[:, : SEQ - 1]  # the last position predicts past the input
    torch.testing.assert_close(mtp_logits, hf_mtp_reference_logits(path, input_ids), atol=1e-5, rtol=1e-5)


def test_megatron_bridge_mtp_layernorm_aliases(megatron_bridge: ModuleType, checkpoint) -> None:
    path = checkpoint("qwen3", mtp=True)
    with ADJUSTMENTS["megatron_bridge.mtp_layernorm_aliases"].suspended():
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'megatron_module'"):
            _megatron_bridge_model(megatron_bridge, path)

    state = _megatron_bridge_model(megatron_bridge, path).state_dict()
    hf = load_file(path / "model.safetensors")
    mtp_layer = "mtp.layers.0.mtp_model_layer"
    assert torch.equal(state[f"{mtp_layer}.input_layernorm.weight"], hf["mtp.layers.0.input_layernorm.weight"])
    assert torch.equal(
        state[f"{mtp_layer}.pre_mlp_layernorm.weight"], hf["mtp.layers.0.post_attention_layernorm.weight"]
    )


# mbridge --------------------------------------------------------------------------------------------------------


def test_mbridge_model_type_encoder_and_decoder(mbridge: ModuleType, checkpoint, input_ids) -> None:
    from megatron.core.transformer.enums import ModelType

    path = checkpoint("qwen3")
    with ADJUSTMENTS["mbridge.model_type_encoder_and_decoder"].suspended():
        with pytest.raises(AttributeError, match="has no attribute 'encoder_and_decoder'"):
            _mbridge_model(mbridge, path)

    assert ModelType.encoder_and_decoder not in list(ModelType)
    _assert_matches_hf(_mbridge_model(mbridge, path), path, input_ids)


def test_mbridge_local_layer_spec(mbridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint("qwen3")
    with ADJUSTMENTS["mbridge.local_layer_spec"].suspended():
        with pytest.raises(TypeError, match="'NoneType' object is not callable") as excinfo:
            _mbridge_model(mbridge, path)
        assert _raised_in(excinfo, "get_gpt_layer_with_transformer_engine_submodules")

    _assert_matches_hf(_mbridge_model(mbridge, path), path, input_ids)


def test_mbridge_rope_theta(mbridge: ModuleType, checkpoint, input_ids, tmp_path: Path) -> None:
    path = checkpoint("qwen3")
    with ADJUSTMENTS["mbridge.rope_theta"].suspended():
        with pytest.raises(AttributeError, match="object has no attribute 'rope_theta'"):
            _mbridge_model(mbridge, path)

    bridge = mbridge.AutoBridge.from_pretrained(str(path), dtype=torch.float32)
    models = bridge.get_model(wrap_with_ddp=False, bf16=False, fp16=False, use_cpu_initialization=True)
    bridge.load_weights(models, str(path))
    _assert_matches_hf(models[0], path, input_ids)
    assert not hasattr(bridge.hf_config, "rope_theta")  # only lent while the model was built
    bridge.save_weights(models, str(tmp_path))
    exported = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in exported
    assert exported["rope_parameters"] == json.loads((path / "config.json").read_text())["rope_parameters"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_mbridge_local_spec_names(mbridge: ModuleType, checkpoint, input_ids, family: Family) -> None:
    path = checkpoint(family)
    with ADJUSTMENTS["mbridge.local_spec_names"].suspended():
        with pytest.raises(NotImplementedError, match="Unsupported parameter name: decoder.layers.0.input_layernorm"):
            _mbridge_model(mbridge, path)

    _assert_matches_hf(_mbridge_model(mbridge, path), path, input_ids)


def test_mbridge_per_bridge_direct_mapping(mbridge: ModuleType, checkpoint, input_ids) -> None:
    from mbridge.models.qwen2 import Qwen2Bridge

    tied, untied = checkpoint("qwen3", tied=True), checkpoint("qwen3")
    class_table = Qwen2Bridge._DIRECT_MAPPING
    original = dict(class_table)
    with ADJUSTMENTS["mbridge.per_bridge_direct_mapping"].suspended():
        try:
            _mbridge_model(mbridge, tied)
            with pytest.raises(ValueError, match="not found in safetensors files"):
                _mbridge_model(mbridge, untied)
        finally:  # undo upstream's rewrite of the class table, which would outlive the test
            class_table.clear()
            class_table.update(original)

    _assert_matches_hf(_mbridge_model(mbridge, tied), tied, input_ids)
    _assert_matches_hf(_mbridge_model(mbridge, untied), untied, input_ids)
    assert class_table == original


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU adjustments apply only without CUDA")
def test_mbridge_get_model_cuda_call_is_covered_by_cpu(mbridge: ModuleType, checkpoint, input_ids) -> None:
    """mbridge/core/util.py:151 calls `.cuda()` unless FSDP2 + CPU init; `cpu.cuda_tensors` already makes it a no-op."""
    path = checkpoint("qwen3")
    cuda_tensors = next(adjustment for adjustment in cpu.ADJUSTMENTS if adjustment.name == "cpu.cuda_tensors")
    with cuda_tensors.suspended():
        with pytest.raises(RuntimeError, match="Invalid device, must be cuda device") as excinfo:
            _mbridge_model(mbridge, path)
        assert _raised_in(excinfo, "get_model", "mbridge/core/util.py")

    _assert_matches_hf(_mbridge_model(mbridge, path), path, input_ids)


# both -----------------------------------------------------------------------------------------------------------


def _patched_objects() -> tuple[Any, ...]:
    """The wrappers and name tables the adjustments install: each install makes new objects."""
    from mbridge.core import llm_bridge
    from mbridge.core.bridge import Bridge
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge

    bridges, tables = (Qwen2Bridge, LLaMABridge), ("_OTHER_MAPPING", "_MLP_MAPPING")
    name_tables = [getattr(bridge, table) for bridge in bridges for table in tables]
    return (
        MegatronMappingRegistry._add_separate_layernorm_mappings,
        LlamaBridge.provider_bridge,
        llm_bridge.get_gpt_decoder_block_spec,
        llm_bridge.LLMBridge._model_provider,
        Bridge.__init__,
        *name_tables,
    )


def test_applying_twice_is_harmless(megatron_bridge: ModuleType, mbridge: ModuleType, checkpoint, input_ids) -> None:
    before = _patched_objects()
    assert _compat.import_megatron_bridge() is megatron_bridge
    assert _compat.import_mbridge() is mbridge
    assert all(adjustment.apply() for adjustment in ADJUSTMENTS.values())
    after = _patched_objects()
    assert all(now is then for now, then in zip(after, before, strict=True))
    assert "transformer_engine" not in sys.modules

    path = checkpoint("qwen3")
    _assert_matches_hf(_megatron_bridge_model(megatron_bridge, path), path, input_ids)
    _assert_matches_hf(_mbridge_model(mbridge, path), path, input_ids)
