"""The optimizer's CPU offload (`MegatronStrategy(optimizer_offload_fraction=...)`): what Megatron-Core is asked for
and that it accepts it without Transformer Engine, each refusal naming the option and the fix, and on a GPU that an
offloaded fit trains like the one on the GPU, keeps the states where the fraction says and resumes from its
checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import os
import typing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron.module import SFTModule
from lightning_megatron.optimizer import (
    check_optimizer_offload_device,
    megatron_optimizer,
    offloaded,
    with_optimizer_classes,
    without_optimizer_classes,
)
from lightning_megatron.safe_load import UnsafeFileError, load_torch_file
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._distributed import run_in_fresh_process

SEQ, VOCAB, STEPS, LR = 32, 384, 4, 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("offload") / "qwen3", "qwen3")


def test_the_option_keeps_its_name_type_and_default():
    """LightningCLI reads the signature's type hints; configs and user code name the parameter."""
    assert typing.get_type_hints(MegatronStrategy.__init__)["optimizer_offload_fraction"] is float
    assert inspect.signature(MegatronStrategy).parameters["optimizer_offload_fraction"].default == 0.0
    assert MegatronStrategy(hf_checkpoint="unused", optimizer_offload_fraction=1).optimizer_offload_fraction == 1


@pytest.mark.parametrize(("options", "message"), [
    (dict(optimizer_offload_fraction=1.5), "optimizer_offload_fraction: 1.5 must be a number from 0"),
    (dict(optimizer_offload_fraction=-0.1), "optimizer_offload_fraction: -0.1 must be a number from 0"),
    (dict(optimizer_offload_fraction=True), "optimizer_offload_fraction: True must be a number from 0"),
    (dict(optimizer_offload_fraction="half"), "optimizer_offload_fraction: 'half' must be a number from 0"),
    (dict(optimizer_offload_fraction=0.5, use_distributed_optimizer=False),
     "optimizer_offload_fraction: 0.5 needs use_distributed_optimizer: true"),
    (dict(optimizer_offload_fraction=0.5, precision="fp32"),
     "optimizer_offload_fraction: 0.5 needs precision: bf16 .* got fp32; set precision: bf16 or "
     "optimizer_offload_fraction: 0"),
], ids=["above_one", "negative", "bool", "text", "no_distributed_optimizer", "fp32"])
def test_what_the_offload_cannot_serve_is_refused_when_the_strategy_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(hf_checkpoint="unused", **options)
    MegatronStrategy(hf_checkpoint="unused", use_distributed_optimizer=False, precision="fp32")  # nothing offloaded


def test_fp32_parameters_reach_the_hybrid_optimizer_as_views_torch_refuses(model_parallel):
    """Why fp32 is refused: Megatron-Core's precision-aware distributed optimizer rebuilds the hybrid optimizer from
    its shards, and an fp32 parameter's shard is a view of it, not a leaf (distrib_optimizer.py:466-469)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tests._megatron import tiny_gpt

    model = tiny_gpt(mtp_layers=0)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        get_megatron_optimizer(offloaded(config, 1.0), [ddp])


def test_the_offload_asks_megatron_core_for_the_precision_aware_hybrid_optimizer():
    """Megatron-Core keeps the master weights inside the hybrid optimizer (no fp32 copy on the GPU) only through the
    precision-aware path, which otherwise wants Transformer Engine's FusedAdam; offloaded, it is accepted here."""
    from megatron.core.optimizer import OptimizerConfig

    base = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                           use_distributed_optimizer=True)
    config = offloaded(base, 0.25)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction) == (True, 0.25)
    assert config.use_precision_aware_optimizer and config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    # nothing else changed (but TE FusedAdam's `store_param_remainders`, which Megatron-Core turns off without TE)
    assert config.store_param_remainders is False
    unchanged = dataclasses.replace(base, optimizer_offload_fraction=0.25)
    assert dataclasses.replace(config, use_precision_aware_optimizer=False, optimizer_cpu_offload=False,
                               store_param_remainders=True) == unchanged
    with pytest.raises(RuntimeError, match="requires FusedAdam from TransformerEngine"):
        dataclasses.replace(config, optimizer_cpu_offload=False)  # why it is only offered with the offload
    for refused in (dataclasses.replace(base, optimizer="sgd"),
                    dataclasses.replace(base, decoupled_weight_decay=False)):
        with pytest.raises(ValueError, match="offloads Adam with decoupled weight decay only"):
            offloaded(refused, 0.5)


def test_the_offload_needs_a_cuda_device():
    with pytest.raises(ValueError, match="optimizer_offload_fraction: 0.5 needs a CUDA device .* got cpu; set "
                                         r"optimizer_offload_fraction: 0 \(or train on a GPU\)"):
        check_optimizer_offload_device(0.5, torch.device("cpu"))
    check_optimizer_offload_device(0.0, torch.device("cpu"))
    check_optimizer_offload_device(0.5, torch.device("cuda", 0))


def test_an_offloaded_fit_on_the_cpu_is_refused_before_the_model_is_built(process_group, checkpoint, tmp_path):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), optimizer_offload_fraction=0.5)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="optimizer_offload_fraction: 0.5 needs a CUDA device"):
        trainer.fit(SFTModule(), DataLoader(RandomTokenDataset(4, SEQ, VOCAB), batch_size=1))
    assert strategy.model_chunks == []


def _offloaded_optimizer() -> Any:
    """Megatron's optimizer with all of it offloaded, for a tiny bf16 GPT: on the CPU it is built (not stepped)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests._megatron import tiny_gpt

    model = tiny_gpt(mtp_layers=0, bf16=True).bfloat16()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    return megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR), [ddp], bf16=True,
                              use_distributed_optimizer=True, clip_grad=1.0, offload_fraction=1.0).megatron_optimizer


def _saved_and_loaded(state: Any) -> Any:
    """`state` written with torch.save, as a checkpoint's common state is, and read back as loading reads it."""
    stream = io.BytesIO()
    torch.save(state, stream)
    stream.seek(0)
    return load_torch_file(stream, "common_state")


def test_the_offloaded_optimizer_keeps_its_classes_out_of_checkpoints_and_takes_them_back(model_parallel):
    """The hybrid optimizer's param groups hold the classes it steps with, which Megatron saves in a checkpoint's
    common state and safe loading refuses (the resume of the GPU test failed so); left out, the state loads and the
    live optimizer gives them back, so the param groups loaded equal those saved."""
    optimizer = _offloaded_optimizer()
    common = optimizer.state_dict()  # what DistributedOptimizer.sharded_state_dict saves besides the tensors
    for group in common["optimizer"]["param_groups"]:
        assert {key: value for key, value in group.items() if isinstance(value, type)} == {
            "cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": torch.optim.AdamW}
    with pytest.raises(UnsafeFileError, match=r"common_state: refused to load: it holds torch\.optim\.adamw\.AdamW"):
        _saved_and_loaded(common)
    saved = without_optimizer_classes(optimizer, copy.deepcopy(common))
    assert with_optimizer_classes(optimizer, _saved_and_loaded(saved)) == common


def test_the_classes_are_left_out_of_every_form_megatron_saves_the_state_in(model_parallel):
    """A format that is not fully reshardable wraps the state in a `ShardedObject` (distrib_optimizer.py:1536); a
    `ChainedOptimizer` of several keeps one state each, a list from `state_dict`, by index when sharded."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.optimizer import ChainedOptimizer

    single = _offloaded_optimizer()
    common = single.state_dict()
    wrapped = {key: ShardedObject(f"optimizer.distributed.dp_group_idx_0.{key}", value, (1,), (0,))
               for key, value in copy.deepcopy(common).items()}
    unwrapped = {key: value.data for key, value in without_optimizer_classes(single, wrapped).items()}
    assert with_optimizer_classes(single, _saved_and_loaded(unwrapped)) == common
    chained = ChainedOptimizer([*single.chained_optimizers, *_offloaded_optimizer().chained_optimizers])
    states = chained.state_dict()
    assert isinstance(states, list) and len(states) == 2
    for expected in (states, dict(enumerate(states))):  # as state_dict gives them, as sharded_state_dict does
        loaded = _saved_and_loaded(without_optimizer_classes(chained, copy.deepcopy(expected)))
        assert with_optimizer_classes(chained, loaded) == expected


class _Record(pl.Callback):
    """Each step's logged metrics; at the end every weight and where the optimizer holds Adam's first moments."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.metrics.append({key: float(value) for key, value in trainer.callback_metrics.items()})
        if self.stop_after is not None and trainer.global_step >= self.stop_after:
            trainer.should_stop = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.weights = {f"{index}.{name}": p.detach().float().cpu() for index, chunk in enumerate(pl_module.model)
                        for name, p in unwrap_model(chunk).named_parameters()}
        megatron = trainer.optimizers[0].megatron_optimizer
        inner = [part.optimizer for part in getattr(megatron, "chained_optimizers", [megatron])]
        self.optimizers = sorted({type(optimizer).__name__ for optimizer in inner})
        self.state_devices: dict[str, int] = {}
        for optimizer in inner:
            for state in optimizer.state.values():
                device = state["exp_avg"].device.type
                self.state_devices[device] = self.state_devices.get(device, 0) + 1


def _gpu_fits(root: str, checkpoint: str, out: str) -> None:
    """In a fresh process (NCCL, as a real single-GPU run): bf16 fits with nothing, half and all of the optimizer
    offloaded, and the fully offloaded run stopped at step 2, saved and resumed."""
    from lightning_megatron.distributed import free_port, init_single_process

    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()

    def fit(name: str, fraction: float, callbacks: list[pl.Callback], ckpt_path: str | None = None) -> _Record:
        record = callbacks[0]
        strategy = MegatronStrategy(hf_checkpoint=checkpoint, micro_batch_size=2, global_batch_size=4,
                                    precision="bf16", optimizer_offload_fraction=fraction)
        trainer = pl.Trainer(strategy=strategy, accelerator="gpu", devices=1, max_steps=STEPS, log_every_n_steps=1,
                             logger=False, enable_checkpointing=len(callbacks) > 1, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=Path(root) / name, callbacks=callbacks)
        trainer.fit(SFTModule(lr=LR), DataLoader(RandomTokenDataset(4 * STEPS, SEQ, VOCAB), batch_size=2),
                    ckpt_path=ckpt_path)
        return record

    results: dict[str, Any] = {}
    for name, fraction in (("gpu", 0.0), ("half", 0.5), ("all", 1.0)):
        record = fit(name, fraction, [_Record()])
        results[name] = {"metrics": record.metrics, "weights": record.weights, "optimizers": record.optimizers,
                         "state_devices": record.state_devices}
    saver = pl.callbacks.ModelCheckpoint(dirpath=Path(root) / "ckpts", every_n_train_steps=2, save_top_k=-1)
    fit("first", 1.0, [_Record(stop_after=2), saver])
    (saved,) = (Path(root) / "ckpts").glob("*step=2.ckpt")
    resumed = fit("resumed", 1.0, [_Record()], ckpt_path=str(saved))
    results["resumed"] = {"metrics": resumed.metrics, "weights": resumed.weights}
    torch.save(results, out)


@pytest.mark.gpu
def test_an_offloaded_fit_trains_like_the_one_on_the_gpu_and_resumes(checkpoint, tmp_path):
    """bf16 tiny Qwen3, 4 Adam steps: half and all of the optimizer in host memory give the losses, grad norms and
    weights of the fit with the optimizer on the GPU (the same forward on the same weights at step 0; Adam in fp32
    on either device after it), the states where the fraction puts them, and a checkpoint at step 2 resumes to
    the uninterrupted offloaded run's weights."""
    results = run_in_fresh_process(_gpu_fits, tmp_path, str(tmp_path), str(checkpoint))
    reference = results["gpu"]
    assert reference["optimizers"] != ["HybridDeviceOptimizer"] and "cpu" not in reference["state_devices"]
    assert results["all"]["optimizers"] == results["half"]["optimizers"] == ["HybridDeviceOptimizer"]
    assert set(results["all"]["state_devices"]) == {"cpu"}
    assert set(results["half"]["state_devices"]) == {"cpu", "cuda"}
    # each Adam step moves a weight by at most about lr: two runs of STEPS steps differ by at most 2 * STEPS * lr
    # = 8e-4 (< atol), plus bf16's rounding (rtol)
    for name in ("half", "all"):
        run = results[name]
        assert run["metrics"][0]["lm_loss"] == pytest.approx(reference["metrics"][0]["lm_loss"], rel=1e-6), name
        for step, (got, expected) in enumerate(zip(run["metrics"], reference["metrics"], strict=True)):
            for key in ("lm_loss", "grad_norm"):
                assert got[key] == pytest.approx(expected[key], rel=2e-2), (name, step, key)
        for weight, value in reference["weights"].items():
            torch.testing.assert_close(run["weights"][weight], value, rtol=2e-2, atol=2e-3, msg=f"{name}: {weight}")
    resumed, uninterrupted = results["resumed"], results["all"]
    assert len(resumed["metrics"]) == STEPS - 2
    for got, expected in zip(resumed["metrics"], uninterrupted["metrics"][2:], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-3)
    for weight, value in uninterrupted["weights"].items():
        torch.testing.assert_close(resumed["weights"][weight], value, rtol=2e-2, atol=2e-3, msg=weight)
