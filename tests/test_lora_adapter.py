"""The PEFT adapter file a weight sync writes every few steps: streamed from the export into the layout of the last
write, it is byte for byte what safetensors itself writes of megatron-bridge's PEFT state, at every write, after the
adapters trained on, and after another set of adapters (a new layout); `peft` loads it onto the HF model with the
Megatron model's logits. (A fit's export of both forms: tests/test_lora.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from lightning_megatron import lora
from lightning_megatron._compat import import_peft
from lightning_megatron.bridges import Bridge, create_bridge
from lightning_megatron.lora import LoRAConfig, add_lora_adapters, write_lora_adapter
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

SEQ, VOCAB = 16, 384


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lora_adapter") / "qwen3", "qwen3")


def _adapted(bridge: Bridge, config: LoRAConfig, seed: int) -> list[torch.nn.Module]:
    """A model with adapters whose B is not zero (a fresh one's is: the adapters would change nothing)."""
    chunks = bridge.build(ModelOptions())
    add_lora_adapters(chunks, config)
    _train(chunks, seed)
    return chunks


def _train(chunks: list[torch.nn.Module], seed: int) -> None:
    """New values in every adapter, as training steps give them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for name, parameter in chunk.named_parameters():
                if ".adapter." in name:
                    parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))


def _library_file(bridge: Bridge, chunks: list[torch.nn.Module]) -> bytes:
    """What the adapter file was before it streamed: megatron-bridge's PEFT state of host copies, by safetensors."""
    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple
    from megatron.bridge.models.conversion.peft_bridge import convert_adapter_weights_to_peft_state

    exported = [HFWeightTuple(name, tensor.detach().cpu().clone()) for name, tensor in
                bridge.export_adapter_weights(chunks)]
    state, _, _ = convert_adapter_weights_to_peft_state(exported)
    return save(state, metadata={"format": "pt"})


def test_every_adapter_file_is_safetensors_own_bytes_whether_streamed_or_laid_out_afresh(model_parallel, checkpoint,
                                                                                       tmp_path, monkeypatch):
    layouts: list[int] = []  # new layouts made, per write
    real_layout = lora.safetensors_layout
    monkeypatch.setattr(lora, "safetensors_layout", lambda specs: layouts.append(1) or real_layout(specs))
    bridge = create_bridge("megatron-bridge", checkpoint)
    every_linear = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    qkv_only = _adapted(bridge, LoRAConfig(target_modules=["linear_qkv"], rank=8, alpha=32), seed=1)
    configs = []
    for step, (chunks, new_layout) in enumerate([(every_linear, True), (every_linear, False), (every_linear, False),
                                                 (qkv_only, True), (every_linear, True)]):
        if step == 2:
            _train(every_linear, seed=2)  # the same adapters, other values: streamed into the same layout
        folder = write_lora_adapter(bridge, chunks, tmp_path / f"v{step}", extra_files={"note.json": "{}\n"})
        assert (folder / "adapter_model.safetensors").read_bytes() == _library_file(bridge, chunks), step
        assert len(layouts) == new_layout, step
        assert sorted(path.name for path in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                  "note.json"]
        configs.append(json.loads((folder / "adapter_config.json").read_text()))
        layouts.clear()
    assert (tmp_path / "v1" / "adapter_model.safetensors").read_bytes() != \
        (tmp_path / "v2" / "adapter_model.safetensors").read_bytes()
    assert configs[0] == configs[1] == configs[2] == configs[4]
    assert (configs[0]["r"], configs[0]["lora_alpha"], len(configs[0]["target_modules"])) == (4, 8, 7)
    assert (configs[3]["r"], configs[3]["lora_alpha"]) == (8, 32)
    assert sorted(configs[3]["target_modules"]) == ["k_proj", "q_proj", "v_proj"]


def test_a_streamed_adapter_loads_in_peft_with_the_megatron_logits(model_parallel, checkpoint, tmp_path):
    import transformers

    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    write_lora_adapter(bridge, chunks, tmp_path / "first")
    _train(chunks, seed=3)
    folder = write_lora_adapter(bridge, chunks, tmp_path / "streamed")  # into the first write's layout
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = chunks[0].eval()
    with torch.no_grad():
        megatron = model(input_ids=input_ids, position_ids=torch.arange(SEQ).expand_as(input_ids),
                         attention_mask=None)
        base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        base_logits = base(input_ids).logits
        logits = import_peft().PeftModel.from_pretrained(base, folder).eval()(input_ids).logits
    assert (logits - megatron).abs().max() <= 1e-5  # as tests/test_lora.py bounds the fit's export
    assert (base_logits - megatron).abs().max() > 1e-2  # the adapters do change the model


@pytest.mark.gpu
def test_a_gpu_models_adapter_file_is_staged_from_the_gpu_with_the_same_bytes(model_parallel, checkpoint, tmp_path):
    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    assert next(chunks[0].parameters()).is_cuda
    for step in range(2):  # laid out afresh, then streamed into that layout
        _train(chunks, seed=step)
        folder = write_lora_adapter(bridge, chunks, tmp_path / f"v{step}")
        assert (folder / "adapter_model.safetensors").read_bytes() == _library_file(bridge, chunks), step
