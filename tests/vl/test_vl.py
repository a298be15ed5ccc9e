"""Qwen2.5-VL and Qwen3-VL image + text SFT: HF parity, packed == one sequence per row, Qwen3-VL CP=2 == CP=1,
export round trip, the data path's errors and refusals, and the tiny config's fit.

Everything runs on the project's tiny VL checkpoints and generated pictures (`lightning_megatron.testing.vl`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file

from lightning_megatron.data.jsonl import DataValidationError
from lightning_megatron.testing.vl import VL_FAMILIES, make_tiny_vl_checkpoint, make_tiny_vl_data
from lightning_megatron.vl.data import (
    PackedVLDataset,
    PaddedVLDataset,
    VLSFTDataModule,
    collate_vl,
    load_image_processor,
    read_vl_jsonl,
    tokenize_vl_examples,
)
from tests._adam import comparable_adam_eps
from tests._distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
VL_LR = 1e-3
COMPARABLE = {"adam_eps": comparable_adam_eps(VL_LR)}  # the CP=2 and CP=1 fits compared to 1e-5 (tests/_adam.py)


@pytest.fixture(scope="module")
def vl_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl_checkpoints")
    return {family: make_tiny_vl_checkpoint(root / family, family) for family in VL_FAMILIES}


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vl_data(tmp_path_factory.mktemp("vl_data"), 8)


@pytest.fixture(scope="module")
def vl_models(process_group: None, vl_checkpoints: dict[str, Path]) -> dict[str, Any]:
    """Each family built once through megatron-bridge (fp32, per-token loss, unfused CE: the strategy's fp32 build)."""
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    overrides = {"calculate_per_token_loss": True, "cross_entropy_loss_fusion": False}
    models = {}
    for family, path in vl_checkpoints.items():
        bridge = create_bridge("megatron-bridge", path)
        models[family] = (bridge, bridge.build(ModelOptions(config_overrides=overrides))[0])
    return models


def _examples(checkpoint: Path, data: Path) -> list[Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    examples, _ = tokenize_vl_examples(read_vl_jsonl(data), tokenizer, load_image_processor(checkpoint),
                                       max_tokens=512, drop_overlong=False)
    return examples


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_logits_match_hugging_face_text_only_and_with_images(vl_models, vl_checkpoints, vl_data, family):
    from transformers import AutoModelForImageTextToText

    _, model = vl_models[family]
    examples = _examples(vl_checkpoints[family], vl_data)
    with_two_images = next(e for e in examples if len(e.image_grid_thw) == 2)
    text_only = next(e for e in examples if len(e.image_grid_thw) == 0)
    hf = AutoModelForImageTextToText.from_pretrained(vl_checkpoints[family], dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    image_token_id = hf.config.image_token_id
    for example in (with_two_images, text_only):
        ids = example.input_ids[None]
        vision = ({"pixel_values": example.pixel_values, "image_grid_thw": example.image_grid_thw}
                  if len(example.image_grid_thw) else {})
        with torch.no_grad():
            ours = model.eval()(input_ids=ids, position_ids=None, attention_mask=None, **vision)
            # HF falls back to 1-D positions without mm_token_type_ids (transformers >= 5.3)
            reference = hf(input_ids=ids, mm_token_type_ids=(ids == image_token_id).int(), **vision).logits
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_packed_rows_equal_one_sequence_per_row(vl_models, vl_checkpoints, vl_data, family):
    """Losses and every gradient (vision tower included) of four sequences, two with two images and one text-only,
    packed into one THD row vs padded one per row."""
    from lightning_megatron.vl.module import VLSFTModule

    _, model = vl_models[family]
    model.train()
    examples = _examples(vl_checkpoints[family], vl_data)[:4]
    pad_id = 0
    module = VLSFTModule()

    def losses_and_grads(microbatches: list[dict[str, torch.Tensor]]) -> tuple[list[float], dict[str, torch.Tensor]]:
        """Each sequence's mean response loss, and the gradients of the mean over all response tokens."""
        model.zero_grad(set_to_none=True)
        per_sequence, total, tokens = [], 0.0, 0
        for microbatch in microbatches:
            per_token = module.forward_step(model, microbatch)
            loss_sum, count, _ = module.loss_func(microbatch, per_token)
            total, tokens = total + loss_sum, tokens + int(count)
            bounds = microbatch.get("cu_seqlens", torch.tensor([0, per_token.shape[1]])).tolist()
            for start, end in zip(bounds[:-1], bounds[1:]):
                mask = microbatch["loss_mask"][0, start:end]
                if mask.sum() > 0:
                    per_sequence.append(float((per_token[0, start:end] * mask).sum() / mask.sum()))
        (total / tokens).backward()
        return per_sequence, {n: p.grad.clone() for n, p in model.named_parameters()}

    rows = [collate_vl([PaddedVLDataset(examples, 64, pad_id)[i]]) for i in range(len(examples))]
    packed = PackedVLDataset(examples, 256, pad_id)
    assert len(packed) == 1
    row_losses, row_grads = losses_and_grads(rows)
    packed_losses, packed_grads = losses_and_grads([collate_vl([packed[0]])])
    assert len(packed_losses) == len(examples)
    assert packed_losses == pytest.approx(row_losses, abs=1e-5)
    assert any(name.startswith(("visual.", "vision_model.")) for name in row_grads)
    for name, grad in row_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_export_round_trip_is_bit_identical(vl_models, vl_checkpoints, family, tmp_path):
    bridge, model = vl_models[family]
    exported = bridge.save_hf([model], tmp_path / "export")
    source = load_file(vl_checkpoints[family] / "model.safetensors")
    written = load_file(exported / "model.safetensors")
    assert written.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(written[name], tensor), name
    assert (exported / "preprocessor_config.json").is_file() and (exported / "tokenizer_config.json").is_file()


def test_bad_rows_fail_with_file_line_and_image_path(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    rows = [
        '{"messages": [{"role": "user", "content": [{"type": "image", "image": "missing.png"}]}, '
        '{"role": "assistant", "content": "x"}]}',
        '{"messages": [{"role": "user", "content": [{"type": "image", "image": "broken.png"}]}, '
        '{"role": "assistant", "content": "x"}]}',
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '
        '[{"type": "image", "image": "ok.png"}]}]}',
        '{"messages": [{"role": "user", "content": [{"type": "video", "video": "ok.png"}]}, '
        '{"role": "assistant", "content": "x"}]}',
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataValidationError) as error:
        read_vl_jsonl(data)
    message = str(error.value)
    assert f"{data}:1: messages[0].content[0]: image 'missing.png' not found (looked for {tmp_path / 'missing.png'})" \
        in message
    assert f"{data}:2: messages[0].content[0]: image 'broken.png' ({tmp_path / 'broken.png'}) cannot be read" in message
    assert f"{data}:3: messages[1].content[0]: an assistant turn cannot hold an image" in message
    assert f"{data}:4: messages[0].content[0] must be" in message


def test_overlong_rows_are_reported_or_dropped_never_cut(vl_checkpoints, vl_data):
    from transformers import AutoTokenizer

    checkpoint = vl_checkpoints["qwen3_vl"]
    tokenizer, processor = AutoTokenizer.from_pretrained(checkpoint), load_image_processor(checkpoint)
    rows = read_vl_jsonl(vl_data)
    with pytest.raises(DataValidationError, match=r":3: has \d+ tokens \(images included\), more than the 48"):
        tokenize_vl_examples(rows, tokenizer, processor, max_tokens=48, drop_overlong=False)
    kept, dropped = tokenize_vl_examples(rows, tokenizer, processor, max_tokens=48, drop_overlong=True)
    assert dropped > 0 and all(len(example) <= 48 for example in kept)


def test_vl_options_a_model_cannot_serve_are_refused_naming_model_and_option(vl_checkpoints):
    from lightning_megatron.bridges import BridgeError, create_bridge
    from lightning_megatron.bridges.vl import VLOptionError, check_vl_options
    from lightning_megatron.options import ModelOptions

    config = create_bridge("megatron-bridge", vl_checkpoints["qwen2_5_vl"]).hf_config
    with pytest.raises(VLOptionError, match=r"context_parallel_size: 2 is not supported for Qwen2\.5-VL"):
        check_vl_options(config, context_parallel_size=2)
    with pytest.raises(BridgeError, match="Qwen2.5-VL checkpoints are built through megatron-bridge here; set "
                                          "bridge_type: megatron-bridge"):
        create_bridge("mbridge", vl_checkpoints["qwen2_5_vl"]).validate(ModelOptions())
    qwen3_vl = create_bridge("megatron-bridge", vl_checkpoints["qwen3_vl"]).hf_config
    check_vl_options(qwen3_vl, context_parallel_size=2)
    with pytest.raises(VLOptionError, match="attention_backend: local is not supported for Qwen3-VL"):
        check_vl_options(qwen3_vl, context_parallel_size=1, attention_backend="local")


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["lm_loss"]))
        self.grad_norms.append(float(trainer.callback_metrics["grad_norm"]))


def _fit(tmp: Path, checkpoint: Path, data: Path, devices: int, module_kwargs: dict[str, Any] | None = None,
         **strategy_options: Any) -> dict[str, Any]:
    """Five steps of packed image + text SFT through Lightning and MegatronStrategy; losses, grad norms, weights."""
    from megatron.core.utils import unwrap_model

    from lightning_megatron import MegatronStrategy
    from lightning_megatron.vl.module import VLSFTModule

    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", micro_batch_size=1,
                                global_batch_size=2, precision="fp32", **strategy_options)
    record = _Record()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=tmp, callbacks=[record])
    data_module = VLSFTDataModule(train_path=str(data), seq_length=128, packing=True)
    trainer.fit(VLSFTModule(**{"lr": VL_LR, **(module_kwargs or {})}), datamodule=data_module)
    weights = {name: p.detach().clone() for name, p in unwrap_model(strategy.model_chunks[0]).named_parameters()}
    return {"losses": record.losses, "grad_norms": record.grad_norms, "weights": weights}


def _context_parallel_fit(rank: int, world_size: int, tmp: str, checkpoint: str, data: str) -> dict[str, Any]:
    return _fit(Path(tmp) / f"rank{rank}", Path(checkpoint), Path(data), world_size,
                module_kwargs=COMPARABLE, context_parallel_size=2)


@pytest.mark.slow
def test_qwen3_vl_context_parallel_2_equals_1(process_group, vl_checkpoints, vl_data, tmp_path):
    """Two CP ranks, each fusing the images into the full packed row and keeping its half of every sequence, train
    exactly as one process does: five steps' losses, gradient norms and the final weights to 1e-5 (both with
    Adam's eps = 10 lr, whose steps are Lipschitz in the gradients: tests/_adam.py)."""
    checkpoint = vl_checkpoints["qwen3_vl"]
    cp2 = run_distributed(_context_parallel_fit, tmp_path, str(tmp_path), str(checkpoint), str(vl_data))
    cp1 = _fit(tmp_path / "cp1", checkpoint, vl_data, 1, module_kwargs=COMPARABLE)
    assert len(cp1["losses"]) == 5 and cp1["losses"][-1] < cp1["losses"][0]
    for rank in cp2:
        assert rank["losses"] == pytest.approx(cp1["losses"], abs=1e-5)
        assert rank["grad_norms"] == pytest.approx(cp1["grad_norms"], abs=1e-5)
        for name, weight in cp1["weights"].items():
            torch.testing.assert_close(rank["weights"][name], weight, rtol=0, atol=1e-5, msg=name)


def test_tiny_config_fit_lowers_the_response_loss(tmp_path):
    """`lightning-megatron-vl fit --config configs/tiny/vl_sft.yaml`: 20 steps of packed image + text SFT on the
    committed generated pictures, with a tiny Qwen3-VL made on first use; the logged response loss falls."""
    import csv
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    command = [sys.executable, "-m", "lightning_megatron.cli.vl", "fit", "--config", "configs/tiny/vl_sft.yaml",
               "--trainer.strategy.init_args.hf_checkpoint", str(tmp_path / "tiny-qwen3-vl"),
               "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path)]
    with open(tmp_path / "log.txt", "w") as log:
        completed = subprocess.run(command, cwd=ROOT, stdout=log, stderr=log, timeout=600, env=env)
    assert completed.returncode == 0, (tmp_path / "log.txt").read_text()[-3000:]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as metrics:
        losses = [float(row["lm_loss"]) for row in csv.DictReader(metrics) if row.get("lm_loss")]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_freeze_vision_tower_leaves_only_the_projection_and_language_model_trainable(vl_models, vl_checkpoints,
                                                                                     family):
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.vl.module import VLSFTModule

    model = create_bridge("megatron-bridge", vl_checkpoints[family]).build(
        VLSFTModule(freeze_vision_tower=True).model_options())[0]
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    tower = (("visual.patch_embed", "visual.blocks") if family == "qwen2_5_vl"
             else ("vision_model.patch_embed", "vision_model.pos_embed", "vision_model.decoder.layers"))
    assert frozen and all(name.startswith(tower) for name in frozen)
    assert all(p.requires_grad for name, p in model.named_parameters() if name.startswith("language_model."))


def test_qwen25_vl_trains_through_lightning_at_cp1(process_group, vl_checkpoints, vl_data, tmp_path):
    result = _fit(tmp_path, vl_checkpoints["qwen2_5_vl"], vl_data, 1)
    assert len(result["losses"]) == 5 and result["losses"][-1] < result["losses"][0]
    assert all(norm > 0 for norm in result["grad_norms"])
