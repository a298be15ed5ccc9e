"""Each VL adjustment (`_compat/vl.py`): megatron-bridge's Qwen-VL path fails or is wrong here without it, and
works with it (the logits checks against Hugging Face are in tests/vl/test_vl.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_megatron import _compat
from lightning_megatron._compat import vl
from lightning_megatron.testing.vl import make_tiny_vl_checkpoint, make_tiny_vl_data

ADJUSTMENTS = {adjustment.name: adjustment for adjustment in vl.MEGATRON_BRIDGE_ADJUSTMENTS}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, process_group: None) -> dict[str, Path]:
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    _compat.import_megatron_bridge()
    root = tmp_path_factory.mktemp("compat_vl")
    return {family: make_tiny_vl_checkpoint(root / family, family) for family in ("qwen2_5_vl", "qwen3_vl")}


def _build(path: Path) -> torch.nn.Module:
    """What `MegatronBridge.build` does, without its `import_megatron_bridge()` (which would re-apply a suspended
    adjustment)."""
    from megatron.bridge import AutoBridge  # imported with the adjustments by the fixture

    from lightning_megatron.attention import with_core_attention
    from lightning_megatron.bridges.vl import prepare_vl_provider
    from lightning_megatron.hf_io import read_json

    auto_bridge = AutoBridge.from_hf_pretrained(str(path))
    provider = auto_bridge.to_megatron_provider(load_weights=False)
    provider.transformer_layer_spec = with_core_attention(provider.transformer_layer_spec, "auto")
    prepare_vl_provider(provider, read_json(path / "config.json"), "auto")
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, mixed_precision_wrapper=None,
                                               use_cpu_initialization=True)[0]
    auto_bridge.load_hf_weights([model])
    return model.eval()


def test_qwen25_vl_mrope_section_is_copied_from_the_hf_config(checkpoints):
    adjustment = ADJUSTMENTS["megatron_bridge.qwen25_vl_mrope_section"]
    auto_bridge = _compat.import_megatron_bridge().AutoBridge.from_hf_pretrained(str(checkpoints["qwen2_5_vl"]))
    assert adjustment.active
    ids = torch.tensor([[1, 20, 30, 40]])
    with adjustment.suspended():
        assert auto_bridge.to_megatron_provider(load_weights=False).mrope_section == [16, 24, 24]
        model = _build(checkpoints["qwen2_5_vl"])
        with pytest.raises(RuntimeError, match="split_with_sizes"), torch.no_grad():
            model(input_ids=ids, position_ids=None, attention_mask=None)
    assert adjustment.active
    assert auto_bridge.to_megatron_provider(load_weights=False).mrope_section == [2, 3, 3]
    with torch.no_grad():
        assert _build(checkpoints["qwen2_5_vl"])(input_ids=ids, position_ids=None, attention_mask=None).shape[1] == 4


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="applies only without TE")
def test_qwen3_vl_builds_from_local_specs_without_transformer_engine(checkpoints):
    from lightning_megatron.attention import SDPAttention

    with ADJUSTMENTS["megatron_bridge.qwen3_vl_local_specs"].suspended(), \
            pytest.raises(TypeError, match="'NoneType' object is not callable"):
        _build(checkpoints["qwen3_vl"])
    model = _build(checkpoints["qwen3_vl"])
    assert not [name for name, module in model.named_modules() if type(module).__name__.startswith("TE")]
    vision_attention = model.vision_model.decoder.layers[0].self_attention.core_attention
    language_attention = model.language_model.decoder.layers[0].self_attention.core_attention
    assert isinstance(vision_attention, SDPAttention) and isinstance(language_attention, SDPAttention)
    assert vision_attention.cp_group is None  # whole images, even inside a context-parallel model


def test_qwen3_vl_patch_mergers_use_hugging_faces_exact_gelu(checkpoints, tmp_path):
    from transformers import AutoModelForImageTextToText

    from lightning_megatron.vl.data import load_image_processor, read_vl_jsonl, tokenize_vl_example

    path = checkpoints["qwen3_vl"]
    data = make_tiny_vl_data(tmp_path, 1, text_only_every=0)
    from transformers import AutoTokenizer

    example = tokenize_vl_example(read_vl_jsonl(data)[0], AutoTokenizer.from_pretrained(path),
                                  load_image_processor(path))
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf.model.visual(example.pixel_values, grid_thw=example.image_grid_thw).pooler_output

    def image_embeddings() -> torch.Tensor:
        with torch.no_grad():
            return _build(path).vision_model(hidden_states=example.pixel_values, grid_thw=example.image_grid_thw)[0]

    with ADJUSTMENTS["megatron_bridge.qwen3_vl_merger_gelu"].suspended():
        assert (image_embeddings() - reference).abs().max() > 1e-4
    torch.testing.assert_close(image_embeddings(), reference, rtol=0, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="applies only without TE")
def test_packed_context_parallel_indices_without_transformer_engine(checkpoints):
    """Qwen3-VL cuts packed rows for CP through Megatron-Core's per-document balancing, which calls Transformer
    Engine's kernel; without TE the torch version gives each rank the chunks the data pipeline's split gives it."""
    from megatron.core import utils

    from lightning_megatron.microbatch import context_parallel_positions

    adjustment = ADJUSTMENTS["megatron_core.thd_partitioned_indices"]
    bounds = [0, 8, 24, 32]
    with adjustment.suspended(), pytest.raises(AttributeError, match="thd_get_partitioned_indices"):
        utils.tex.thd_get_partitioned_indices(torch.tensor(bounds), 32, 2, 0)
    for cp_size in (2, 4):
        for rank in range(cp_size):
            indices = utils.tex.thd_get_partitioned_indices(torch.tensor(bounds, dtype=torch.int32), 32, cp_size, rank)
            assert indices.tolist() == context_parallel_positions(bounds, rank, cp_size).tolist()
