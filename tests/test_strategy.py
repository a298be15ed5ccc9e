"""MegatronStrategy under a real Lightning Trainer equals the plain Megatron-Core loop, resumes exactly, and saves
checkpoints that a crash cannot corrupt."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from bench.megatron_loop import LoopConfig
from bench.megatron_loop import run as run_reference_loop
from lightning_megatron import checkpoint as megatron_checkpoint
from lightning_megatron.module import SFTModule
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._distributed import init_one_gpu_process, run_distributed, run_in_fresh_process

SEQ, VOCAB, SAMPLES = 16, 384, 32
LR, WARMUP = 1e-3, 1
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("strategy_checkpoints")
    return {"qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3"),
            "qwen3_4_layers": make_tiny_checkpoint(root / "qwen3_4_layers", "qwen3", num_layers=4)}


class RecordLosses(pl.Callback):
    """The loss each training step returned, as Lightning saw it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _trainer(tmp_path: Path, strategy: MegatronStrategy, steps: int, devices: int = 1, **kwargs: Any) -> pl.Trainer:
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
    return pl.Trainer(strategy=strategy, devices=devices, max_steps=steps, default_root_dir=tmp_path,
                      **{**defaults, "accelerator": "cpu", **kwargs})


def _loader(batch_size: int) -> DataLoader:
    return DataLoader(RandomTokenDataset(SAMPLES, SEQ, VOCAB), batch_size=batch_size, drop_last=True)


def _fit(tmp_path: Path, hf_checkpoint: Path, steps: int, devices: int = 1, callbacks: tuple = (),
         ckpt_path: str | None = None, trainer_kwargs: dict | None = None, validate: bool = False,
         **strategy_kwargs: Any) -> dict[str, Any]:
    options = dict(micro_batch_size=2, global_batch_size=4, precision="fp32") | strategy_kwargs
    strategy = MegatronStrategy(hf_checkpoint=str(hf_checkpoint), **options)
    recorder = RecordLosses()
    trainer = _trainer(tmp_path, strategy, steps, devices, callbacks=[recorder, *callbacks], **(trainer_kwargs or {}))
    val_loader = _loader(options["micro_batch_size"]) if validate else None
    trainer.fit(SFTModule(lr=LR, warmup_steps=WARMUP), _loader(options["micro_batch_size"]), val_loader,
                ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "weights": _weights(strategy.model_chunks), "trainer": trainer,
            "val_lm_loss": float(trainer.callback_metrics["val_lm_loss"]) if validate else None}


def _weights(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    return {f"{index}.{name}": param.detach().to("cpu", copy=True)
            for index, chunk in enumerate(chunks) for name, param in unwrap_model(chunk).named_parameters()}


def _reference(hf_checkpoint: Path, steps: int, **overrides: Any) -> dict[str, Any]:
    config = LoopConfig(hf_checkpoint=str(hf_checkpoint), micro_batch_size=2, global_batch_size=4, lr=LR,
                        warmup_steps=WARMUP, steps=steps, **overrides)
    result = run_reference_loop(config, RandomTokenDataset(SAMPLES, SEQ, VOCAB))
    return {"losses": result["losses"], "weights": _weights(result["model"])}


def test_one_process_matches_the_plain_megatron_loop(process_group, checkpoints, tmp_path):
    steps = 6
    ours = _fit(tmp_path, checkpoints["qwen3"], steps)
    reference = _reference(checkpoints["qwen3"], steps)
    assert len(ours["losses"]) == steps
    assert ours["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    assert ours["losses"][-1] < ours["losses"][0]
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][name], tensor, rtol=0, atol=1e-6)


def _distributed_case(rank: int, world_size: int, tmp: str, hf_checkpoint: str, parallel: dict) -> dict:
    from lightning.pytorch.loggers import CSVLogger

    from lightning_megatron.callbacks import HFExport, TrainingCurves

    steps = 4
    reference = _reference(Path(hf_checkpoint), steps, **parallel)["losses"]
    # a logger, then callbacks whose end-of-fit work is collective (Trainer.log_dir broadcasts; the export gathers)
    callbacks = (TrainingCurves(), HFExport(dirpath=str(Path(tmp) / "export")))
    ours = _fit(Path(tmp) / f"rank{rank}", Path(hf_checkpoint), steps, devices=world_size, callbacks=callbacks,
                trainer_kwargs=dict(num_sanity_val_steps=1, limit_val_batches=2, val_check_interval=2,
                                    logger=CSVLogger(Path(tmp) / "logs")),
                validate=True, **parallel)
    trainer = ours["trainer"]
    # after the last step's validation: the kept model, split over the same ranks, on the same batches
    validated = trainer.validate(trainer.lightning_module, _loader(2), verbose=False)[0]["val_lm_loss"]
    reduced = {op: trainer.strategy.reduce(torch.tensor([rank + 1, 4 * rank]), reduce_op=op).tolist()
               for op in ("mean", "sum", "max", "min", torch.distributed.ReduceOp.MAX)}
    return {"ours": ours["losses"], "reference": reference, "val_lm_loss": ours["val_lm_loss"], "validated": validated,
            "curves": sorted(path.name for path in (Path(tmp) / "logs").rglob("curves.*")),
            "reduced": {str(op): value for op, value in reduced.items()}}


@pytest.mark.slow
@pytest.mark.parametrize("parallel, model", [
    (dict(tensor_model_parallel_size=2), "qwen3"),
    (dict(pipeline_model_parallel_size=2), "qwen3"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), "qwen3_4_layers"),
    ({}, "qwen3"),  # two processes, nothing but data parallelism: DP=2
], ids=["tp2", "pp2", "pp2_vpp2", "dp2"])
def test_two_processes_match_the_plain_megatron_loop(checkpoints, tmp_path, parallel, model):
    results = run_distributed(_distributed_case, tmp_path, str(tmp_path), str(checkpoints[model]), parallel)
    for result in results:
        assert len(result["ours"]) == 4
        assert result["ours"] == pytest.approx(result["reference"], abs=1e-6)
    assert results[0]["ours"] == results[1]["ours"]  # every rank logs the same, reduced loss
    # sanity check and in-fit validation ran through the forward-only schedule, pipelined ones included
    assert results[0]["val_lm_loss"] == results[1]["val_lm_loss"] > 0
    assert [result["validated"] for result in results] == [results[0]["val_lm_loss"]] * 2  # the trained model's
    assert results[0]["curves"] == ["curves.json", "curves.png"]  # rank 0 wrote them, and no rank hung
    for result in results:  # what Lightning's sync_dist asks of the strategy, an integer mean included
        assert result["reduced"] == {"mean": [1, 2], "sum": [3, 4], "max": [2, 4], "min": [1, 0],
                                     str(torch.distributed.ReduceOp.MAX): [2, 4]}
    assert (tmp_path / "export" / "model.safetensors").is_file()


class StopAfter(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.parametrize("stop_at", [5, 10], ids=["mid_epoch_0", "mid_epoch_1"])
def test_resume_equals_the_uninterrupted_run_bit_for_bit(process_group, checkpoints, tmp_path, stop_at):
    steps = 12  # 8 steps per epoch: the run crosses an epoch boundary
    options = dict(precision="bf16", use_distributed_optimizer=True)
    uninterrupted = _fit(tmp_path / "full", checkpoints["qwen3"], steps, **options)

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=stop_at, save_top_k=-1)
    first = _fit(tmp_path / "first", checkpoints["qwen3"], steps, callbacks=(StopAfter(stop_at), saver),
                 trainer_kwargs=dict(enable_checkpointing=True), **options)
    saved = tmp_path / "ckpts" / f"epoch={(stop_at - 1) // 8}-step={stop_at}.ckpt"
    assert megatron_checkpoint.is_complete(saved)
    resumed = _fit(tmp_path / "second", checkpoints["qwen3"], steps, ckpt_path=str(saved), **options)

    assert first["losses"] == uninterrupted["losses"][:stop_at]
    assert resumed["losses"] == uninterrupted["losses"][stop_at:]
    assert resumed["trainer"].global_step == steps
    unequal = [name for name, tensor in uninterrupted["weights"].items()
               if not torch.equal(tensor, resumed["weights"][name])]
    assert unequal == []


_CRASHING_RUN = textwrap.dedent("""
    import collections, os, sys
    import lightning.pytorch as pl
    from tests.test_strategy import _fit

    class DieWhileSaving:
        armed = False
        def __reduce__(self):
            if DieWhileSaving.armed:
                os._exit(17)  # the process dies half-way through writing a checkpoint
            return (collections.OrderedDict, ())  # loadable anywhere, weights-only too

    class CrashOnSecondSave(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            DieWhileSaving.armed = trainer.global_step >= 4
        def state_dict(self):
            return {"bomb": DieWhileSaving()}

    if __name__ == "__main__":
        workdir, hf_checkpoint = sys.argv[1], sys.argv[2]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
        saver = pl.callbacks.ModelCheckpoint(dirpath=workdir + "/ckpts", every_n_train_steps=2, save_top_k=-1,
                                             save_last=True)
        _fit(workdir, hf_checkpoint, 6, callbacks=(CrashOnSecondSave(), saver),
             trainer_kwargs=dict(enable_checkpointing=True))
""")


@pytest.mark.slow
def test_a_checkpoint_killed_mid_write_is_never_picked_up(process_group, checkpoints, tmp_path):
    from tests._distributed import free_port

    script, log = tmp_path / "crashing_run.py", tmp_path / "crashing_run.log"
    script.write_text(_CRASHING_RUN)
    with log.open("w") as output:  # not a pipe: the dying run leaves dist_checkpointing's helper process behind
        run = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(checkpoints["qwen3"]),
                                str(free_port())], cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        try:
            returncode = run.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
    assert returncode == 17, log.read_text()[-3000:]

    ckpts = tmp_path / "ckpts"
    assert sorted(path.name for path in ckpts.glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    partial = ckpts / ".epoch=0-step=4.ckpt.partial"
    assert (partial / "megatron").is_dir() and not megatron_checkpoint.is_complete(partial)
    with pytest.raises(megatron_checkpoint.CheckpointError, match="not a complete MegatronStrategy checkpoint"):
        megatron_checkpoint.load(partial, [], None)

    resumed = _fit(tmp_path / "resume", checkpoints["qwen3"], 6, ckpt_path=str(ckpts / "last.ckpt"))
    assert len(resumed["losses"]) == 4  # steps 3..6, continuing from the last complete checkpoint (step 2)


class FreezeEmbeddingAndFirstLayer(pl.Callback):
    """Freezes in `setup`, before Megatron DDP and the optimizer exist; records what DDP and the optimizer saw."""

    frozen_prefixes = ("embedding.", "decoder.layers.0.")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name, param in pl_module.model[0].named_parameters():
            if name.startswith(self.frozen_prefixes):
                param.requires_grad_(False)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.model_chunks[0]
        self.ddp_params = {id(param) for buffer in ddp.buffers for param in buffer.params}
        optimizer = trainer.optimizers[0].megatron_optimizer
        self.optimizer_numel = sum(param.numel() for param in optimizer.get_parameters())


def test_freezing_in_callback_setup_keeps_frozen_params_out_of_ddp_and_optimizer(process_group, checkpoints,
                                                                                   tmp_path):
    from megatron.core.utils import unwrap_model

    freezer = FreezeEmbeddingAndFirstLayer()
    before = _weights([unwrap_model(chunk) for chunk in _build_only(checkpoints["qwen3"])])
    result = _fit(tmp_path, checkpoints["qwen3"], 3, callbacks=(freezer,), use_distributed_optimizer=False)
    model = unwrap_model(result["trainer"].strategy.model_chunks[0])
    frozen = {name: param for name, param in model.named_parameters() if name.startswith(freezer.frozen_prefixes)}
    trainable = {name: param for name, param in model.named_parameters() if name not in frozen}
    assert frozen and trainable
    assert not any(id(param) in freezer.ddp_params for param in frozen.values())
    assert all(id(param) in freezer.ddp_params for param in trainable.values())
    assert freezer.optimizer_numel == sum(param.numel() for param in trainable.values())
    for name in frozen:
        assert torch.equal(result["weights"][f"0.{name}"], before[f"0.{name}"]), name
    assert all(not torch.equal(result["weights"][f"0.{name}"], before[f"0.{name}"]) for name in trainable)


def _build_only(hf_checkpoint: Path) -> list[torch.nn.Module]:
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    return create_bridge("mbridge", hf_checkpoint).build(ModelOptions())


def test_export_hf_after_fit_gives_the_trained_weights_to_transformers(process_group, checkpoints, tmp_path):
    import transformers

    result = _fit(tmp_path, checkpoints["qwen3"], 2)
    strategy = result["trainer"].strategy
    exported = strategy.export_hf(tmp_path / "export")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = strategy.model_chunks[0].eval()
    with torch.no_grad():
        ours = model(input_ids=input_ids, position_ids=torch.arange(SEQ).expand(2, SEQ), attention_mask=None)
        theirs = hf_model(input_ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    original = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.float32)
    assert not torch.equal(original.model.embed_tokens.weight, hf_model.model.embed_tokens.weight)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_finished_fit_frees_its_model_once_the_trainer_is_dropped(process_group, tmp_path, family):
    """Megatron DDP's hooks on the gradient accumulators, the optimizer's views of the parameters and an MoE
    dispatcher's kept routing probabilities made cycles through autograd nodes that the garbage collector cannot
    see: every fit kept its model for the life of the process (a notebook, a sweep). The MTP head trains too; a
    validation after the fit runs the same model, which goes with the module."""
    checkpoint = make_tiny_checkpoint(tmp_path / family, family, mtp=True)
    chunk = _fit_and_drop(tmp_path, checkpoint)
    gc.collect()
    assert chunk() is None, "the fit's model chunk is still referenced after the trainer, strategy and module went"


def _memory_after_a_dropped_gpu_fit(checkpoint: str, root: str, out: str) -> None:
    """In a fresh process with NCCL: the device memory before and after a fit whose objects are dropped."""
    init_one_gpu_process()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    chunk = _fit_and_drop(Path(root), Path(checkpoint), accelerator="gpu", precision="bf16")
    gc.collect()
    torch.cuda.synchronize()
    torch.save({"kept": chunk() is not None, "extra_bytes": torch.cuda.memory_allocated() - before}, out)


@pytest.mark.gpu
def test_a_finished_bf16_fit_on_a_gpu_gives_its_memory_back(tmp_path):
    """On the device, with bf16 weights, fp32 main weights and Adam states: a kept model would leave at least
    (2 + 4 + 4 + 4 + 4) bytes a parameter allocated (weights, grads, main weights, two Adam states); what may stay
    (the allocator's rounding, small module-level caches) is far below one bf16 copy of the weights."""
    from safetensors.torch import load_file

    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", mtp=True)
    result = run_in_fresh_process(_memory_after_a_dropped_gpu_fit, tmp_path, str(checkpoint), str(tmp_path / "fit"))
    assert not result["kept"]
    bf16_weights_bytes = 2 * sum(tensor.numel() for file in checkpoint.glob("*.safetensors")
                                 for tensor in load_file(file).values())
    assert result["extra_bytes"] < bf16_weights_bytes


def _fit_and_drop(tmp_path: Path, hf_checkpoint: Path, accelerator: str = "cpu",
                  precision: str = "fp32") -> weakref.ref:
    """A 2-step fit and a validation of the trained model, whose trainer, strategy and module are dropped when it
    returns (in a function of its own: the module's `save_hyperparameters` snapshots its callers' locals, which a
    `del` would not clear); a reference to the model."""
    from megatron.core.utils import unwrap_model

    strategy = MegatronStrategy(hf_checkpoint=str(hf_checkpoint), bridge_type="megatron-bridge", micro_batch_size=2,
                                global_batch_size=4, precision=precision)
    trainer = _trainer(tmp_path, strategy, 2, accelerator=accelerator, limit_val_batches=1)
    module = SFTModule(lr=LR, warmup_steps=WARMUP, enable_mtp=True)
    trainer.fit(module, _loader(2))
    assert trainer.global_step == 2
    trainer.validate(module, _loader(2), verbose=False)
    return weakref.ref(unwrap_model(strategy.model_chunks[0]))


class RecordStartWeights(pl.Callback):
    """The weights each fit's training starts from."""

    def __init__(self) -> None:
        self.starts: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.starts.append(_weights(trainer.strategy.model_chunks))


def _two_fits(checkpoint: Path, root: Path, accelerator: str) -> dict[str, Any]:
    """Two fits of one module and strategy (the second goes on to twice the steps): what the test checks of them."""
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), micro_batch_size=2, global_batch_size=4,
                                precision="bf16")
    recorder, weights = RecordLosses(), RecordStartWeights()
    steps = 3 if accelerator == "gpu" else 1  # a graph's warm-up, capture and replay
    trainer = _trainer(root, strategy, steps, callbacks=[recorder, weights], accelerator=accelerator)
    module = SFTModule(lr=LR, warmup_steps=WARMUP)
    trainer.fit(module, _loader(2))
    first, trained = weakref.ref(strategy.model_chunks[0]), _weights(strategy.model_chunks)
    trainer.fit_loop.epoch_loop.max_steps = 2 * steps
    trainer.fit(module, _loader(2))
    gc.collect()
    graph = strategy.cuda_graphs.graph
    return {"steps": steps, "global_step": trainer.global_step, "losses": len(recorder.losses),
            "graph_counts": None if graph is None else graph.counts(), "first_kept": first() is not None,
            "trained": trained, "starts": weights.starts, "after": _weights(strategy.model_chunks)}


def _two_fits_on_a_gpu(checkpoint: str, root: str, out: str) -> None:
    """`_two_fits` in a fresh process with NCCL."""
    init_one_gpu_process()
    torch.save(_two_fits(Path(checkpoint), Path(root), "gpu"), out)


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_second_fit_goes_on_from_the_first_ones_weights_and_frees_its_wrappers(process_group, checkpoints,
                                                                                  tmp_path, accelerator):
    """As Lightning's second `fit` of a module: its weights as the first left them, a new optimizer. In bf16 with
    the distributed optimizer: Float16Module and Megatron DDP (whose buffer held the parameters) wrap them anew; on
    a GPU each fit captures its CUDA graph over its own wrappers."""
    if accelerator == "gpu":
        fits = run_in_fresh_process(_two_fits_on_a_gpu, tmp_path, str(checkpoints["qwen3"]), str(tmp_path / "fits"))
    else:
        fits = _two_fits(checkpoints["qwen3"], tmp_path, accelerator)
    steps, trained, starts = fits["steps"], fits["trained"], fits["starts"]
    assert fits["global_step"] == 2 * steps and fits["losses"] == 2 * steps
    if accelerator == "gpu":
        assert fits["graph_counts"] == {"warmups": 1, "captures": 1, "replays": 1, "eager": 0}
    assert not fits["first_kept"], "the first fit's wrapped chunk is still referenced after the second fit wrapped anew"
    assert any(not torch.equal(trained[name], starts[0][name]) for name in trained)  # the first fit stepped
    assert starts[1].keys() == trained.keys()
    assert [name for name in trained if not torch.equal(starts[1][name], trained[name])] == []
    assert any(not torch.equal(tensor, trained[name]) for name, tensor in fits["after"].items())


def _lm_loss(chunk: torch.nn.Module, microbatches: list[dict[str, torch.Tensor]]) -> float:
    """The token-weighted loss of `microbatches` through a bare model chunk, computed here."""
    from lightning_megatron.microbatch import model_inputs
    from lightning_megatron.module import masked_token_loss

    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for microbatch in microbatches:
            loss_sum, tokens, _ = masked_token_loss(microbatch, chunk.eval()(**model_inputs(microbatch)))
            totals += torch.stack([loss_sum.double(), tokens.double()])
    return float(totals[0] / totals[1])


def test_evaluating_a_fitted_module_runs_its_trained_weights(process_group, checkpoints, tmp_path):
    """Lightning's `validate` and `test` without ckpt_path run the module's weights as they are: after `fit`, the
    trained ones (not the HF checkpoint's again), on the same Trainer and on a new one. A run that would build the
    model otherwise (another precision) is refused, naming what differs."""
    from megatron.core.utils import unwrap_model

    options = dict(hf_checkpoint=str(checkpoints["qwen3"]), micro_batch_size=2, global_batch_size=4, precision="fp32")
    strategy = MegatronStrategy(**options)
    trainer = _trainer(tmp_path, strategy, 3, limit_val_batches=1, limit_test_batches=1)
    module = SFTModule(lr=1e-2)
    trainer.fit(module, _loader(2))
    global_batch = list(itertools.islice(_loader(2), 2))  # the one validation and test run
    trained = _lm_loss(unwrap_model(strategy.model_chunks[0]), global_batch)
    untrained = _lm_loss(_build_only(checkpoints["qwen3"])[0], global_batch)
    gradients = weakref.ref(strategy.model_chunks[0].buffers[0].grad_data)
    validated = trainer.validate(module, _loader(2), verbose=False)[0]["val_lm_loss"]
    gc.collect()
    assert gradients() is None, "the fit's gradient buffer (DDP, optimizer, main_grad views) outlived it"
    tested = trainer.test(module, _loader(2), verbose=False)[0]["test_lm_loss"]
    another = _trainer(tmp_path, MegatronStrategy(**options), 1, limit_val_batches=1).validate(
        module, _loader(2), verbose=False)[0]["val_lm_loss"]
    # float32 losses of the same forward, summed in another order: a few units in the last place of ~6 (4.8e-7)
    tolerance = 1e-5
    assert abs(trained - untrained) > 1000 * tolerance
    assert [validated, tested, another] == pytest.approx([trained] * 3, rel=0, abs=tolerance)
    with pytest.raises(ValueError, match=r"options\.params_dtype: torch\.float32 -> torch\.bfloat16"):
        _trainer(tmp_path, MegatronStrategy(**options | dict(precision="bf16")), 1).validate(module, _loader(2))


def test_load_checkpoint_accepts_lightning_2_5_and_2_6_call_forms(process_group, checkpoints, tmp_path):
    result = _fit(tmp_path, checkpoints["qwen3"], 1)
    strategy, trainer = result["trainer"].strategy, result["trainer"]
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    trainer.state.fn = pl.trainer.states.TrainerFn.VALIDATING  # weights only, as trainer.validate(ckpt_path) does
    assert strategy.load_checkpoint(tmp_path / "saved.ckpt")["global_step"] == 1  # 2.5: load_checkpoint(path)
    assert strategy.load_checkpoint(tmp_path / "saved.ckpt", weights_only=False)["global_step"] == 1  # 2.6


@pytest.mark.parametrize("trainer_kwargs, message", [
    (dict(gradient_clip_val=1.0), "set MegatronStrategy\\(clip_grad=...\\)"),
    (dict(accumulate_grad_batches=2), "set MegatronStrategy\\(global_batch_size=...\\)"),
    (dict(precision="bf16-mixed"), "set MegatronStrategy\\(precision='bf16' or 'fp32'\\)"),
])
def test_trainer_options_that_megatron_replaces_fail_before_the_model_is_built(process_group, checkpoints, tmp_path,
                                                                              trainer_kwargs, message):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoints["qwen3"]))
    trainer = _trainer(tmp_path, strategy, 1, **trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(SFTModule(), _loader(1))
    assert strategy.model_chunks == []


def test_a_global_batch_that_does_not_split_into_microbatches_is_rejected(process_group, checkpoints, tmp_path):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoints["qwen3"]), micro_batch_size=2, global_batch_size=5)
    with pytest.raises(ValueError, match="global_batch_size: 5 must be a multiple of micro_batch_size"):
        _trainer(tmp_path, strategy, 1).fit(SFTModule(), _loader(2))


@pytest.mark.parametrize("kwargs, message", [
    (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
    (dict(sequence_parallel=True), "sequence_parallel: true needs tensor_model_parallel_size > 1"),
    (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size: 0 must be a positive integer"),
    (dict(precision="fp16"), "precision: 'fp16' is not one of"),
    (dict(clip_grad=-1.0), "clip_grad: -1.0 must be >= 0"),
])
def test_invalid_strategy_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(hf_checkpoint="unused", **kwargs)


def test_a_world_size_that_does_not_fit_the_parallel_sizes_is_rejected(process_group, checkpoints, tmp_path):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoints["qwen3"]), tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="world size 1 is not a multiple of tensor x pipeline x context"):
        _trainer(tmp_path, strategy, 1).fit(SFTModule(), _loader(1))


def test_one_process_needs_no_launcher_so_notebooks_work(checkpoints, tmp_path):
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoints["qwen3"]))
    _trainer(tmp_path, strategy, 1)
    assert strategy.launcher is None
