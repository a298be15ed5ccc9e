"""MTP training through the strategy: MTP-only leaves the backbone bit-identical and trains exactly Megatron's
scaled MTP loss; joint training moves everything; bad combinations fail before a model is built."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset

from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.parameters import is_mtp_parameter
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._distributed import run_distributed
from tests.mtp._helpers import (
    COMPARABLE,
    SAMPLES,
    SEQ,
    VOCAB,
    HeadGradients,
    RecordedLogs,
    Snapshot,
    assert_main_head_on_demand_changes_only_lm_loss,
    assert_only_mtp_moved,
    fit,
    named_parameters,
)

SCALE = 0.1


@pytest.mark.parametrize("model", ["qwen3_mtp", "mimo"])
def test_mtp_only_trains_the_mtp_head_and_nothing_else(process_group, checkpoints, tmp_path, model):
    snapshot, trainer = fit(tmp_path, checkpoints[model], 3, trust_remote_code=model == "mimo")
    assert_only_mtp_moved(snapshot)
    assert {"lm_loss", "mtp_loss", "mtp_accuracy", "grad_norm_mtp"} <= set(snapshot.metrics[-1])
    audit = json.loads((tmp_path / "mtp_only_audit.json").read_text())
    assert audit["frozen_bit_identical"] and audit["frozen_tensors_changed"] == 0
    assert audit["trainable_parameters"] == snapshot.optimizer_numel


class NudgeFrozenNorm(pl.Callback):
    """Changes one frozen tensor behind the optimizer's back after the first step."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from megatron.core.utils import unwrap_model

        with torch.no_grad():
            unwrap_model(pl_module.model[0]).decoder.final_layernorm.weight.add_(1.0)


def test_the_audit_fails_the_run_when_a_frozen_tensor_changes(process_group, checkpoints, tmp_path):
    with pytest.raises(RuntimeError, match=r"1 frozen tensor\(s\) changed during fit, e.g. "
                                           r"\['0.decoder.final_layernorm.weight'\]"):
        fit(tmp_path, checkpoints["qwen3_mtp"], 1, callbacks=(NudgeFrozenNorm(),))
    audit = json.loads((tmp_path / "mtp_only_audit.json").read_text())
    assert not audit["frozen_bit_identical"] and audit["frozen_tensors_changed"] == 1

def test_the_audit_checksum_does_not_depend_on_its_chunk_size():
    """The audit checksums in bounded chunks; the value is the whole-tensor one, int64 wrap-around included."""
    from lightning_megatron.callbacks.mtp_only import checksum

    def whole_tensor(tensor: torch.Tensor) -> tuple[int, int]:
        bits = tensor.view(torch.int32).reshape(-1).to(torch.int64)
        weights = torch.arange(bits.numel(), dtype=torch.int64) % 1_000_003 + 1
        return int(bits.sum()), int((bits * weights).sum())

    large_bits = torch.full((3_000_001,), 2**31 - 1, dtype=torch.int32).view(torch.float32)  # the weighted sum wraps
    for tensor in (torch.randn(301, 77), large_bits):
        expected = whole_tensor(tensor)
        assert checksum(tensor, chunk_elements=1000) == checksum(tensor, chunk_elements=1 << 30) == expected
    weights_total = int((torch.arange(large_bits.numel(), dtype=torch.int64) % 1_000_003 + 1).sum())
    assert (2**31 - 1) * weights_total > 2**63  # so the second tensor's weighted sum did wrap


def _distributed_mtp_only(rank: int, world_size: int, tmp: str, hf_checkpoint: str, parallel: dict) -> dict:
    """Chunked losses with the main head in every step, whole logits (the previous implementation) and chunked
    losses with the main head on demand (the default: in the steps the logger records) on the same ranks."""
    from megatron.core import parallel_state

    runs, logs = {}, {}
    for name, chunk_tokens, every in (("chunked", 8, 1), ("whole_logits", None, 1), ("on_demand", 8, None)):
        heads, logs[name] = HeadGradients(), RecordedLogs()
        snapshot, trainer = fit(Path(tmp) / name, Path(hf_checkpoint), 2, devices=world_size, callbacks=(heads,),
                                loss_chunk_tokens=chunk_tokens, log_lm_loss_every_n_steps=every, logger=logs[name],
                                log_every_n_steps=2, module_kwargs=COMPARABLE, **parallel)
        runs[name] = snapshot, trainer, heads
    (snapshot, trainer, heads), (whole, _, whole_heads) = runs["chunked"], runs["whole_logits"]
    mtp = {name for name in snapshot.before if is_mtp_parameter(name)}
    torch.distributed.barrier()  # global rank 0 writes the audits at the end of fit
    audits = {name: json.loads((Path(tmp) / name / "mtp_only_audit.json").read_text()) for name in runs}
    assert_main_head_on_demand_changes_only_lm_loss(
        (runs["on_demand"][0], runs["on_demand"][2], audits["on_demand"]), (snapshot, heads, audits["chunked"]),
        logs["on_demand"].steps, logs["chunked"].steps)
    return {
        "main_head_calls": [heads.training_calls, runs["on_demand"][2].training_calls],
        "has_mtp": bool(mtp),
        "frozen_moved": [name for name in snapshot.before if name not in mtp
                         and not torch.equal(snapshot.before[name], snapshot.after[name])],
        "mtp_unchanged": [name for name in mtp if torch.equal(snapshot.before[name], snapshot.after[name])],
        "trainable_is_mtp": snapshot.trainable == mtp,
        "optimizer_numel": snapshot.optimizer_numel,
        "mtp_numel": sum(snapshot.before[name].numel() for name in mtp),
        "steps": trainer.global_step,
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "mtp_loss": snapshot.metrics[-1]["mtp_loss"],
        "head_gradients": [heads.gradients, whole_heads.gradients],
        "chunked_mtp_loss": [heads.chunked_mtp_loss, whole_heads.chunked_mtp_loss],
        "metrics": [snapshot.metrics, whole.metrics],
        "mtp_grads": [snapshot.mtp_grads, whole.mtp_grads],
        "audits": [audits["chunked"], audits["whole_logits"]],
    }


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(tensor_model_parallel_size=2),
                                      dict(pipeline_model_parallel_size=2)], ids=["tp2", "pp2"])
def test_mtp_only_under_tensor_and_pipeline_parallelism(checkpoints, tmp_path, parallel):
    """MTP-only trains the MTP head alone on every rank; chunked losses log the same `lm_loss`, `mtp_loss`,
    `mtp_accuracy`, give the same MTP gradients and the same audit as whole logits; so does the main head on demand
    (`lm_loss` in the logged steps only, computed there on the last stage alone)."""
    results = run_distributed(_distributed_mtp_only, tmp_path, str(tmp_path), str(checkpoints["qwen3_mtp"]), parallel)
    for result in results:
        assert result["frozen_moved"] == [] and result["mtp_unchanged"] == [] and result["trainable_is_mtp"]
        assert result["optimizer_numel"] == result["mtp_numel"]
        assert result["steps"] == 2  # a stage without the MTP layer still steps with the others
        assert result["has_mtp"] == result["last_stage"]
        # the main LM head's backward is skipped on the last stage (the TP ranks alike), the MTP head's runs
        expected = {"mtp": 4, "main": 0} if result["last_stage"] else {"mtp": 0, "main": 0}
        assert result["head_gradients"] == [expected, expected]
        # 2 steps x 2 microbatches, each the MTP depth's and 4 main-head chunks; on demand only in step 2
        assert result["main_head_calls"] == ([20, 4 + 2 * 4] if result["last_stage"] else [0, 0])
        assert result["chunked_mtp_loss"] == [result["last_stage"], False]
        chunked, whole = result["metrics"]
        assert {"lm_loss", "mtp_loss", "mtp_accuracy", "grad_norm_mtp"} <= set(chunked[-1])
        for ours, theirs in zip(chunked, whole, strict=True):
            assert ours.keys() == theirs.keys() and ours == pytest.approx(theirs, rel=0, abs=1e-6)
        for ours, theirs in zip(*result["mtp_grads"], strict=True):
            assert ours.keys() == theirs.keys()
            for name in ours:
                torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6)
        assert result["audits"][0] == result["audits"][1] and result["audits"][0]["frozen_bit_identical"]
    assert results[0]["mtp_loss"] == results[1]["mtp_loss"] > 0
    if "pipeline_model_parallel_size" in parallel:
        assert results[0]["optimizer_numel"] == 0  # the first stage holds no MTP parameter: everything frozen


def _first_global_batch(dataset: RandomTokenDataset, size: int) -> dict[str, torch.Tensor]:
    """The samples Lightning's DP sampler (shuffled, seed 0, epoch 0) hands to the first step."""
    indices = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))[:size]
    return {key: torch.stack([dataset[i][key] for i in indices]) for key in dataset[0]}


def _direct_mtp_gradient(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """d/dθ of `scale * masked MTP cross-entropy` over the whole global batch, from the MTP layer's own output.

    The target at t is token t+2 (labels rolled once more) and the mask rolls with it, its last position dropped.
    Megatron weights each microbatch's MTP mean by that microbatch's share of the main-loss tokens; every row here
    masks the same number of tokens, so that weighting is the plain token mean over the global batch.
    """
    captured = {}
    hook = model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output))
    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
          labels=batch["labels"], loss_mask=batch["loss_mask"])
    hook.remove()
    hidden = captured["hidden"][SEQ:]  # [s, b, h]: the MTP layer's chunk after the main decoder's
    tied = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=tied)
    targets = torch.roll(batch["labels"], -1, dims=1)
    mask = torch.roll(batch["loss_mask"], -1, dims=1)
    mask[:, -1] = 0
    cross_entropy = F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    loss = SCALE * (cross_entropy * mask.reshape(-1)).sum() / mask.sum()
    names, parameters = zip(*[(f"0.{name}", p) for name, p in model.named_parameters() if is_mtp_parameter(name)])
    return dict(zip(names, torch.autograd.grad(loss, parameters)))


class DirectMTPGradient(pl.Callback):
    """The direct gradient, on the model being trained, right before its first step."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        from megatron.core.utils import unwrap_model

        self.expected = _direct_mtp_gradient(unwrap_model(pl_module.model[0]), self.batch)
        MTPLossLoggingHelper.clean_metrics_in_tracker()  # that forward must not count as a training step's


@pytest.mark.parametrize("model", ["qwen3_mtp", "qwen3_mtp_tied"], ids=["untied", "tied"])
@pytest.mark.parametrize("micro_batch_size", [4, 1], ids=["1_microbatch", "4_microbatches"])
def test_mtp_gradient_is_the_scaled_masked_mtp_cross_entropy(process_group, checkpoints, tmp_path,
                                                            micro_batch_size, model):
    dataset = RandomTokenDataset(SAMPLES, SEQ, VOCAB)
    direct = DirectMTPGradient(_first_global_batch(dataset, 4))
    snapshot, _ = fit(tmp_path, checkpoints[model], 1, dataset=dataset, micro_batch_size=micro_batch_size,
                      module_kwargs={"mtp_loss_scaling_factor": SCALE}, callbacks=(direct,))
    (ours,) = snapshot.mtp_grads
    assert ours.keys() == direct.expected.keys()
    for name, gradient in direct.expected.items():
        torch.testing.assert_close(ours[name], gradient, rtol=0, atol=1e-6)
    assert max(float(g.abs().max()) for g in direct.expected.values()) > 1e-4  # the comparison is not of zeros


def test_joint_training_moves_everything_and_both_losses_fall(process_group, checkpoints, tmp_path):
    fixed_batch = Subset(RandomTokenDataset(SAMPLES, SEQ, VOCAB), range(4))  # every step sees the same batch
    snapshot, _ = fit(tmp_path, checkpoints["qwen3_mtp"], 8, mtp_only=False, dataset=fixed_batch)
    unchanged = [name for name in snapshot.before if torch.equal(snapshot.before[name], snapshot.after[name])]
    assert unchanged == []
    first, last = snapshot.metrics[0], snapshot.metrics[-1]
    assert last["lm_loss"] < first["lm_loss"] - 0.1
    assert last["mtp_loss"] < first["mtp_loss"] - 0.1


class AllGradients(pl.Callback):
    """Every trainable parameter's gradient right before the first optimizer step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not hasattr(self, "gradients"):
            self.gradients = {name: p.main_grad.detach().clone()
                              for name, p in named_parameters(pl_module, keep=True).items() if p.requires_grad}


def _loop_gradients(hf_checkpoint: Path, **overrides: Any) -> dict[str, torch.Tensor]:
    """The gradients of one step of the plain Megatron-Core loop (`bench/megatron_loop.py`) on the same data."""
    from megatron.core.utils import unwrap_model

    from bench.megatron_loop import LoopConfig, run

    config = LoopConfig(hf_checkpoint=str(hf_checkpoint), bridge_type="megatron-bridge", micro_batch_size=2,
                        global_batch_size=4, steps=1, clip_grad=0.0, use_distributed_optimizer=False, **overrides)
    model = run(config, RandomTokenDataset(SAMPLES, SEQ, VOCAB))["model"]
    return {f"{index}.{name}": p.main_grad.detach().clone() for index, chunk in enumerate(model)
            for name, p in unwrap_model(chunk).named_parameters() if p.requires_grad}


def test_joint_training_lets_the_mtp_loss_train_the_trunk_unless_detached(process_group, checkpoints, tmp_path):
    """Default (Megatron-Core's): the trunk's gradient holds the MTP loss's too, as Megatron-Core computes it run
    directly; `mtp_detach_heads: true`: the trunk's gradient is that of the run without MTP."""
    runs = {}
    for detach in (False, True):
        gradients = AllGradients()
        module_kwargs = {} if not detach else {"mtp_detach_heads": True}
        fit(tmp_path / str(detach), checkpoints["qwen3_mtp"], 1, mtp_only=False, clip_grad=0.0,
            module_kwargs=module_kwargs, callbacks=(gradients,))
        runs[detach] = gradients.gradients
    megatron_joint = _loop_gradients(checkpoints["qwen3_mtp"], mtp=True)
    without_mtp = _loop_gradients(checkpoints["qwen3_mtp"], mtp=False)
    assert SFTModule().hparams.mtp_detach_heads is False
    assert runs[False].keys() == megatron_joint.keys() == runs[True].keys()
    for name, gradient in megatron_joint.items():
        torch.testing.assert_close(runs[False][name], gradient, rtol=0, atol=1e-6)
    trunk = [name for name in runs[True] if not is_mtp_parameter(name)]
    assert trunk and set(trunk) == set(without_mtp)
    for name in trunk:
        torch.testing.assert_close(runs[True][name], without_mtp[name], rtol=0, atol=1e-6)
    # the MTP loss's gradient reaches the trunk (embedding, decoder, LM head) only without the detach
    moved_by_mtp = [name for name in trunk if (runs[False][name] - without_mtp[name]).abs().max() > 1e-4]
    assert {"0.embedding.word_embeddings.weight", "0.output_layer.weight"} <= set(moved_by_mtp)
    assert any(".decoder.layers." in name for name in moved_by_mtp)
    for name in runs[True]:  # the MTP layer's own gradient is the same either way
        if is_mtp_parameter(name):
            torch.testing.assert_close(runs[True][name], runs[False][name], rtol=0, atol=1e-6)


def _expect_rejection(tmp_path: Path, hf_checkpoint: Path, message: str, *, bridge_type: str = "megatron-bridge",
                      module_kwargs: dict | None = None, mtp_only: bool = True,
                      mtp_only_callback: MTPOnlyCallback | None = None) -> None:
    strategy = MegatronStrategy(hf_checkpoint=str(hf_checkpoint), bridge_type=bridge_type, precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         callbacks=[mtp_only_callback or MTPOnlyCallback()] if mtp_only else [])
    with pytest.raises(ValueError, match=message):
        trainer.fit(SFTModule(**({"enable_mtp": True} | (module_kwargs or {}))),
                    DataLoader(RandomTokenDataset(4, SEQ, VOCAB), batch_size=1))
    assert strategy.model_chunks == [] and not hasattr(trainer.lightning_module, "model")  # nothing was built


def test_mtp_only_without_megatron_bridge_is_rejected(process_group, checkpoints, tmp_path):
    _expect_rejection(tmp_path, checkpoints["qwen3_mtp"], "MTPOnlyCallback needs bridge_type: megatron-bridge",
                      bridge_type="mbridge")


class ExpertBiasSFTModule(SFTModule):
    def model_options(self) -> Any:
        import dataclasses

        options = super().model_options()
        return dataclasses.replace(options, config_overrides={"moe_router_enable_expert_bias": True})


def test_mtp_only_with_moe_expert_bias_updates_is_rejected(process_group, checkpoints, tmp_path):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoints["qwen3_mtp"]), bridge_type="megatron-bridge")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         callbacks=[MTPOnlyCallback()])
    with pytest.raises(ValueError, match="expert bias every step \\(moe_router_enable_expert_bias with "
                                         "moe_router_bias_update_rate > 0\\)"):
        trainer.fit(ExpertBiasSFTModule(enable_mtp=True), DataLoader(RandomTokenDataset(4, SEQ, VOCAB), batch_size=1))
    assert strategy.model_chunks == []


def test_an_lm_loss_interval_that_would_log_stale_values_is_rejected(process_group, checkpoints, tmp_path):
    """Lightning sends a logger the last value of a metric a step did not log: with the trainer's
    log_every_n_steps (50) an interval of 3 would log stale lm_loss values."""
    _expect_rejection(tmp_path, checkpoints["qwen3_mtp"], r"log_lm_loss_every_n_steps: 3 must divide the trainer's "
                      r"log_every_n_steps \(50\)", mtp_only_callback=MTPOnlyCallback(log_lm_loss_every_n_steps=3))
    with pytest.raises(ValueError, match="log_lm_loss_every_n_steps: 0 must be at least 1"):
        MTPOnlyCallback(log_lm_loss_every_n_steps=0)


def test_mtp_only_without_mtp_training_is_rejected(process_group, checkpoints, tmp_path):
    _expect_rejection(tmp_path, checkpoints["qwen3_mtp"], "set SFTModule\\(enable_mtp=True\\)",
                      module_kwargs={"enable_mtp": False})


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, "0.1"])
def test_a_loss_scale_that_is_not_finite_and_positive_is_rejected(scale):
    with pytest.raises(ValueError, match="mtp_loss_scaling_factor: .* must be finite and > 0"):
        SFTModule(enable_mtp=True, mtp_loss_scaling_factor=scale)


def test_mtp_training_without_the_mtp_head_is_rejected():
    with pytest.raises(ValueError, match="enable_mtp_training: true needs enable_mtp: true"):
        SFTModule(enable_mtp=False, enable_mtp_training=True)


def test_more_than_one_mtp_layer_is_rejected(process_group, checkpoints, tmp_path):
    two_layers = tmp_path / "two_mtp_layers"
    make_tiny_checkpoint(two_layers, "qwen3", mtp=True)
    config = json.loads((two_layers / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2
    (two_layers / "config.json").write_text(json.dumps(config))
    _expect_rejection(tmp_path, two_layers, "supports exactly one MTP layer; the checkpoint declares 2")


def test_a_checkpoint_without_mtp_config_says_how_to_restore_it(process_group, checkpoints, tmp_path):
    _expect_rejection(tmp_path, checkpoints["qwen3"], "declares no MTP layers .*lightning-megatron-restore-mtp")


def test_a_checkpoint_without_mtp_weights_says_how_to_restore_it(process_group, checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    stripped = tmp_path / "mtp_config_no_weights"
    make_tiny_checkpoint(stripped, "qwen3", mtp=True)
    tensors = load_file(stripped / "model.safetensors")
    save_file({name: t for name, t in tensors.items() if not name.startswith("mtp.")}, stripped / "model.safetensors")
    _expect_rejection(tmp_path, stripped, "the weights hold no MTP tensor; restore the head with "
                                          "lightning-megatron-restore-mtp")


def test_sft_data_module_feeds_an_mtp_only_fit(process_group, checkpoints, tmp_path):
    from lightning_megatron.data import SFTDataModule

    rows = [{"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}. Adding a number to itself doubles it."}
            for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoints["qwen3_mtp"]), bridge_type="megatron-bridge",
                                micro_batch_size=2, global_batch_size=4, precision="fp32")
    snapshot = Snapshot()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                         callbacks=[snapshot, MTPOnlyCallback()])
    trainer.fit(SFTModule(enable_mtp=True, lr=1e-2), SFTDataModule(train_path=str(tmp_path / "train.jsonl"),
                                                                   seq_length=48))
    assert_only_mtp_moved(snapshot)
    assert snapshot.metrics[-1]["mtp_loss"] > 0


def test_megatron_fused_cross_entropy_returns_bf16_gradients_so_fp32_runs_turn_it_off(process_group, checkpoints,
                                                                                      tmp_path):
    """Why an fp32 MegatronStrategy sets cross_entropy_loss_fusion=False (megatron-bridge turns it on): upstream's
    fused CE rounds the logit gradients to bf16, which puts the MTP gradient test above off by ~1e-4."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.utils import get_model_config

    _, trainer = fit(tmp_path, checkpoints["qwen3_mtp"], 1)  # also sets up the parallel state used below
    assert get_model_config(trainer.strategy.model_chunks[0]).cross_entropy_loss_fusion is False

    logits = torch.randn(SEQ, 2, VOCAB, requires_grad=True)
    targets = torch.randint(0, VOCAB, (SEQ, 2))
    loss = fused_vocab_parallel_cross_entropy(logits.clone(), targets, parallel_state.get_tensor_model_parallel_group())
    (gradient,) = torch.autograd.grad(loss.sum(), logits)
    exact = torch.softmax(logits.detach(), -1) - F.one_hot(targets, VOCAB)
    assert not torch.allclose(gradient.float(), exact, rtol=0, atol=1e-6)
    torch.testing.assert_close(gradient.float(), exact.to(torch.bfloat16).float(), rtol=0, atol=1e-6)


def test_keeping_the_mtp_head_without_training_it_leaves_it_unchanged(process_group, checkpoints, tmp_path):
    snapshot, _ = fit(tmp_path, checkpoints["qwen3_mtp"], 2, mtp_only=False,
                      module_kwargs={"enable_mtp_training": False})
    mtp = {name for name in snapshot.before if is_mtp_parameter(name)}
    assert mtp and not (snapshot.trainable & mtp)
    assert all(torch.equal(snapshot.before[name], snapshot.after[name]) for name in mtp)
    assert all(not torch.equal(snapshot.before[name], snapshot.after[name]) for name in snapshot.before
               if name not in mtp)
