"""`MegatronStrategy(cuda_graph="auto")`, the default: the whole-iteration graph where the refusal table lets it, eager
elsewhere, said in one log line; a failed warm-up or capture falls back to eager for the rest of the fit.

On the CPU: the default fit is eager, says so in one line and equals a `cuda_graph: none` fit bit for bit; every
whole-iteration row of the table makes auto step aside with its reason (the explicit `full_iteration` raising only
on the rows it always refused); a wrapper that fails under auto hands the batch to the eager schedule with the
same losses, gradients and MTP metrics (nothing of the failed attempt kept). On a GPU: auto trains dense full rows,
packed rows and MTP jointly like eager to bf16 tolerance (losses, grad norms, every gradient), from one capture;
a capture that fails falls back with one warning and the fit ends as the eager one does; checkpointed RNG states
are tensors under the graph-safe tracker the strategy seeds for auto, and resume under either tracker.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron.contract import MegatronLightningModule
from lightning_megatron.cuda_graphs.full_iteration import (
    AUTO_GRAPHED,
    FullIterationGraph,
    StrategyCudaGraphs,
    say_eager,
)
from lightning_megatron.cuda_graphs.options import CudaGraphOptions, IterationGraph
from lightning_megatron.cuda_graphs.refusals import REFUSALS, Mechanism, Setting, auto_reason, check_setting, reason
from lightning_megatron.distributed import ParallelSizes
from lightning_megatron.module import SFTModule
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_in_fresh_process
from tests._megatron import SEQ, token_batch
from tests.cuda_graphs.test_full_graph import ROW, _full_rows, _packed_rows
from tests.mtp._helpers import Snapshot, named_parameters

LOGGER = "lightning_megatron.cuda_graphs.full_iteration"
AUTO, CPU, GPU = CudaGraphOptions(), torch.device("cpu"), torch.device("cuda", 0)
STEPS = 4  # 2 microbatches a step: warm-up, capture, 2 replays


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("auto_graph") / "qwen3_mtp", "qwen3", mtp=True)


class StepCounting(MegatronLightningModule):
    """A module that does not declare its training step replayable (the contract's default)."""


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER]


def _eager_line(why: str) -> str:
    return f"cuda_graph auto: training steps eager: {why}; set cuda_graph: none to silence"


# ---------------------------------------------------------------------------------------------- CPU


def _cpu_fit(root: Path, checkpoint: Path, **strategy_kwargs: Any) -> tuple[Snapshot, MegatronStrategy]:
    snapshot = Snapshot()
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", micro_batch_size=2,
                                global_batch_size=4, precision="fp32", **strategy_kwargs)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, log_every_n_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, callbacks=[snapshot])
    trainer.fit(SFTModule(enable_mtp=True, lr=1e-3), _full_rows(8))
    return snapshot, strategy


def test_the_default_on_the_cpu_is_eager_says_so_once_and_equals_none(process_group, checkpoint, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        default, strategy = _cpu_fit(tmp_path / "default", checkpoint)
        assert _lines(caplog) == [_eager_line("full_iteration needs the model on a CUDA device, got cpu")]
        caplog.clear()
        none, _ = _cpu_fit(tmp_path / "none", checkpoint, cuda_graph="none")
        assert _lines(caplog) == []  # none is silent
    assert strategy.cuda_graphs.options.full_iteration is IterationGraph.AUTO and strategy.cuda_graphs.graph is None
    assert len(default.metrics) == 2 and {"lm_loss", "mtp_loss", "grad_norm"} <= set(default.metrics[-1])
    assert default.metrics == none.metrics  # every logged value of every step, exactly
    for name, value in none.after.items():
        assert torch.equal(default.after[name], value), name


def _first_full_row(subject: object) -> Any:
    """The whole-iteration row auto steps aside on for `subject` (`auto_reason` gives its text)."""
    return next(row for row in REFUSALS if row.mechanism is Mechanism.FULL_ITERATION
                and isinstance(subject, row.subject) and row.applies(subject))


def test_the_line_reaches_a_user_who_configured_no_logging_once(monkeypatch, capsys):
    """Under the root logger's default WARNING the INFO line was never made (a CLI fit showed nothing): the
    package's logger keeps INFO and prints it itself where no root handler would, and only there."""
    root, seen = logging.getLogger(), []
    monkeypatch.setattr(root, "handlers", [])
    say_eager("why")
    assert capsys.readouterr().err == _eager_line("why") + "\n"
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    monkeypatch.setattr(root, "handlers", [handler])
    say_eager("why")
    assert seen == [_eager_line("why")] and capsys.readouterr().err == ""


def test_auto_steps_aside_on_every_row_of_the_table_with_its_reason(model_parallel):
    """Each whole-iteration row, and only it, applies to one subject below: auto gives its reason and raises
    nothing; the explicit full_iteration raises on the same rows as before, and graphs the `auto_only` ones."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lightning_megatron.vl.module import VLSFTModule
    from tests.test_attention import VOCAB as ATTENTION_VOCAB
    from tests.test_attention import _config, _tiny_mtp_gpt

    moe, dropout, adapter_dropout = _tiny_mtp_gpt(), _tiny_mtp_gpt(), _tiny_mtp_gpt()
    moe.config.num_moe_experts = 2  # what a MoE model's config says
    dropout.config.attention_dropout = 0.1
    adapter_dropout.add_module("adapter_dropout", torch.nn.Dropout(0.05))  # as a LoRA adapter's dropout
    local = GPTModel(_config(), get_gpt_layer_local_spec(), vocab_size=ATTENTION_VOCAB, max_sequence_length=ROW)
    anyway = "cuda_graph: full_iteration graphs it anyway"
    cases = [
        (Setting(AUTO, device=CPU), "full_iteration needs the model on a CUDA device, got cpu"),
        (Setting(AUTO, ParallelSizes(pipeline=2)),
         "full_iteration needs pipeline_model_parallel_size: 1, got 2 (the pipeline schedule is not captured)"),
        (Setting(AUTO, ParallelSizes(context=2)),
         "full_iteration needs context_parallel_size: 1, got 2 (the CP cut reads cu_seqlens on the host in the step)"),
        (Setting(AUTO, ParallelSizes(expert=4)),
         "full_iteration needs expert_model_parallel_size: 1, got 4 (MoE routing has data-dependent shapes)"),
        (Setting(AUTO, mtp_only=True), "full_iteration does not serve MTPOnlyCallback (it decides in Python, step by "
         "step, whether the main head runs; replays would repeat one choice)"),
        (Setting(AUTO, module=StepCounting()), "StepCounting does not set replayable_training_step (a replay repeats "
         f"the captured step's Python choices; {anyway})"),
        (Setting(AUTO, module=VLSFTModule()), "VLSFTModule does not set replayable_training_step (a replay repeats "
         f"the captured step's Python choices; {anyway})"),
        (Setting(AUTO, device=GPU, processes=2), "2 processes: a capture that fails on one could not fall back to "
         "eager without the others (cuda_graph: full_iteration graphs them anyway)"),
        (moe, "full_iteration does not serve Mixture of Experts models (token routing has data-dependent shapes)"),
        (local, "full_iteration needs the SDPAttention core (attention_backend: sdpa, or auto without Transformer "
         "Engine)"),
        (dropout, f"dropout while training (attention_dropout 0.1): a graphed step's masks are not shown to equal an "
         f"eager step's ({anyway})"),
        (adapter_dropout, "dropout while training (a torch.nn.Dropout of p 0.05): a graphed step's masks are not "
         f"shown to equal an eager step's ({anyway})"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "subtree_end": torch.full((1, 4), 4)},
         "full_iteration does not serve tree rows (subtree_end)"),
    ]
    rows = []
    for subject, expected in cases:
        row = _first_full_row(subject)
        rows.append(row)
        assert auto_reason(subject) == expected
        if row.auto_only:
            assert reason(Mechanism.FULL_ITERATION, subject) is None  # full_iteration graphs it
        else:
            assert reason(Mechanism.FULL_ITERATION, subject) == f"cuda_graph: {expected}; {row.fix}"
        if isinstance(subject, Setting):
            check_setting(subject)  # auto raises nothing
    assert {id(row) for row in rows} == {id(row) for row in REFUSALS if row.mechanism is Mechanism.FULL_ITERATION}
    for graphable in (Setting(AUTO, device=GPU, module=SFTModule()), _tiny_mtp_gpt(),
                      {"input_ids": torch.zeros(1, 4, dtype=torch.long)}):
        assert auto_reason(graphable) is None


def test_auto_says_in_one_line_why_the_training_steps_stay_eager(model_parallel, caplog):
    """The run's setting (the parallel sizes when the strategy is made, the device, the process count and the
    module in setup_environment, MTP-only training) and then the model decide, the first reason in table order
    (the device before the rest); nothing is raised, no graph is made, the graph-safe RNG is not chosen."""
    from tests.test_attention import _tiny_mtp_gpt

    moe = _tiny_mtp_gpt()
    moe.config.num_moe_experts = 2
    pipeline = "full_iteration needs pipeline_model_parallel_size: 1, got 2 (the pipeline schedule is not captured)"
    cuda = "full_iteration needs the model on a CUDA device, got cpu"
    for strategy_kwargs, run, chunk, expected in [
        (dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2), None, _tiny_mtp_gpt(), pipeline),
        (dict(pipeline_model_parallel_size=2), (CPU, 2, SFTModule()), _tiny_mtp_gpt(), cuda),
        (dict(), (GPU, 1, StepCounting()), _tiny_mtp_gpt(), auto_reason(Setting(AUTO, module=StepCounting()))),
        (dict(), (GPU, 1, SFTModule()), moe, auto_reason(moe)),
    ]:
        graphs = MegatronStrategy(hf_checkpoint="unused", **strategy_kwargs).cuda_graphs
        if run is not None:
            graphs.check_run(*run)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            graphs.make([chunk])
        assert not graphs.may_graph or chunk is moe  # the model is known only when the graph would be made
        assert graphs.graph is None
        assert _lines(caplog) == [_eager_line(expected)]
    mtp_only = MegatronStrategy(hf_checkpoint="unused").cuda_graphs
    mtp_only.check_run(GPU, 1, SFTModule())
    assert mtp_only.may_graph
    mtp_only.check_mtp_only()
    assert not mtp_only.may_graph


def test_the_first_batch_of_tree_rows_leaves_the_fit_eager_said_once(model_parallel, caplog):
    """Nothing known is in the way when the graph is made; its first training batch is tree rows: that batch and
    the rest run through the eager schedule, and the one line says why."""
    from tests.test_attention import _tiny_mtp_gpt

    graphs = StrategyCudaGraphs("auto", 16, ParallelSizes())
    graphs.make([_tiny_mtp_gpt()])
    graph = graphs.graph
    assert isinstance(graph, FullIterationGraph) and graph.auto
    tree = {**token_batch(), "subtree_end": torch.full((2, SEQ), SEQ)}
    calls = []

    def eager_schedule(data_iterator: Any, **kwargs: Any) -> list:  # what the graph hands eager batches to
        calls.append(len(list(data_iterator)))
        return []

    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert graph.static_microbatches([tree]) == [tree]  # kept as they are, not refused
        graph.run(eager_schedule, [tree])
        graph.run(eager_schedule, [token_batch()])
    assert _lines(caplog) == [_eager_line("full_iteration does not serve tree rows (subtree_end)")]
    assert calls == [1, 1] and graph.counts() == {"warmups": 0, "captures": 0, "replays": 0, "eager": 2}
    graphs.release()


def test_a_capture_that_fails_under_auto_hands_the_batch_to_the_eager_schedule(model_parallel, caplog):
    """On the CPU Megatron-Core's wrapper warms up (eagerly, `_compat.cpu`'s streams) and then fails to capture
    (no CUDA graphs): under auto the graph is released, the cause warned about once and the batch run eagerly. What
    the failed step left (junk in the gradient buffers, the MTP loss tracker holding the warm-up's values) is
    dropped, so the losses, every gradient and the MTP tracker equal one eager run's exactly (fp32, the same
    kernels): nothing lost, nothing counted twice. The next batch runs eagerly without trying again."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from lightning_megatron.schedule import run_schedule, wrap_chunks
    from tests.test_attention import _tiny_mtp_gpt

    module = SFTModule(enable_mtp=True)
    model = _tiny_mtp_gpt()
    graph = FullIterationGraph([model], sequences_per_row=16, auto=True)
    chunks = wrap_chunks([model], bf16=False, train=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                         use_distributed_optimizer=False)
    microbatches = [token_batch(seed) for seed in (0, 1)]

    def step(through: FullIterationGraph | None) -> tuple[dict, dict, torch.Tensor]:
        metrics = run_schedule(chunks, microbatches, module.forward_step, module.loss_func, forward_only=False,
                               cut_for_context_parallel=True, device=CPU, graph=through)
        grads = {name: parameter.main_grad.clone() for name, parameter in model.named_parameters()}
        return metrics, grads, MTPLossLoggingHelper.tracker["loss_values"].clone()

    def assert_equal(got: tuple, expected: tuple) -> None:
        (metrics, grads, mtp), (expected_metrics, expected_grads, expected_mtp) = got, expected
        assert metrics.keys() == expected_metrics.keys() == {"lm_loss"}
        assert torch.equal(metrics["lm_loss"], expected_metrics["lm_loss"])
        assert torch.equal(mtp, expected_mtp) and mtp.abs().sum() > 0
        assert grads.keys() == expected_grads.keys() and any(name.startswith("mtp.") for name in grads)
        for name, grad in expected_grads.items():
            assert torch.equal(grads[name], grad), name

    try:
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        chunks[0].zero_grad_buffer()
        eager = step(None)
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        chunks[0].zero_grad_buffer()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert_equal(step(graph), eager)  # the warm-up, through the wrapper
            assert _lines(caplog) == [AUTO_GRAPHED] and graph.counts()["warmups"] == 1
            for buffer in chunks[0].buffers:  # and the tracker keeps the warm-up's values
                buffer.grad_data.fill_(1.0)
            assert_equal(step(graph), eager)  # the capture fails
        said, warning = _lines(caplog)
        assert warning.startswith("cuda_graph auto: the CUDA graph's capture of the training step failed (")
        assert warning.endswith("); that step and the rest of the fit run eagerly; set cuda_graph: none to silence")
        assert graph.stepped_aside is not None and graph.stepped_aside.startswith("the capture failed: ")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            MTPLossLoggingHelper.clean_metrics_in_tracker()
            chunks[0].zero_grad_buffer()
            assert_equal(step(graph), eager)
        assert _lines(caplog) == [] and graph.counts() == {"warmups": 1, "captures": 0, "replays": 0, "eager": 2}
    finally:
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        graph.release()


def test_a_capture_that_fails_under_an_explicit_full_iteration_stops_the_fit(model_parallel):
    """What the user asked for explicitly does not fall back: the failed capture raises, naming the option."""
    from lightning_megatron.schedule import run_schedule, wrap_chunks
    from tests.test_attention import _tiny_mtp_gpt

    module, model = SFTModule(enable_mtp=True), _tiny_mtp_gpt()
    graph = FullIterationGraph([model], sequences_per_row=16)
    chunks = wrap_chunks([model], bf16=False, train=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                         use_distributed_optimizer=False)
    try:
        for _ in range(2):  # the warm-up runs; the capture fails (no CUDA graphs on the CPU)
            chunks[0].zero_grad_buffer()
            run_schedule(chunks, [token_batch()], module.forward_step, module.loss_func, forward_only=False,
                         cut_for_context_parallel=True, device=CPU, graph=graph)
    except RuntimeError as error:
        assert str(error).startswith("cuda_graph: full_iteration: the capture of the training step failed (")
        assert str(error).endswith("; set cuda_graph: none")
    else:
        pytest.fail("the failed capture did not stop the fit")
    finally:
        graph.release()
    assert graph.counts() == {"warmups": 1, "captures": 0, "replays": 0, "eager": 0}


# ---------------------------------------------------------------------------------------------- GPU


class Gradients(pl.Callback):
    """Every trainable parameter's gradient (Megatron DDP's `main_grad`) before each optimizer step, on the host."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.steps.append({name: p.main_grad.detach().float().cpu() for name, p in
                           named_parameters(pl_module, keep=True).items() if p.requires_grad})


class FailsInsideTheCapture(SFTModule):
    """An SFT module whose forward step fails only while a CUDA graph is being captured: by a host read, which
    CUDA refuses inside a capture (`sync`), or by a Python error (`raise`). The failure is injected; what is tested
    is what auto does with it."""

    replayable_training_step = True

    def __init__(self, failure: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failure = failure

    def forward_step(self, model: torch.nn.Module, microbatch: dict) -> torch.Tensor:
        output = super().forward_step(model, microbatch)
        if torch.cuda.is_current_stream_capturing():
            if self.failure == "raise":
                raise RuntimeError("injected failure inside the capture")
            output.sum().item()  # a host read: the capture fails
        return output


# (rows, micro batch size, data, SFTModule's enable_mtp): dense full rows, packed rows, MTP trained jointly
GPU_CASES = {"full": ("full", 2, False), "packed": ("packed", 1, False), "full_mtp": ("full", 2, True)}


def _gpu_fit(root: Path, checkpoint: str, case: str, cuda_graph: str, failure: str | None = None) -> dict[str, Any]:
    rows, micro_batch_size, mtp = GPU_CASES[case]
    snapshot, gradients = Snapshot(), Gradients()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    strategy = MegatronStrategy(hf_checkpoint=checkpoint, bridge_type="megatron-bridge",
                                micro_batch_size=micro_batch_size, global_batch_size=2 * micro_batch_size,
                                cuda_graph=cuda_graph)
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu", devices=1, max_steps=STEPS, log_every_n_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, callbacks=[snapshot, gradients])
    module = (SFTModule(enable_mtp=mtp, lr=1e-4) if failure is None
              else FailsInsideTheCapture(failure, enable_mtp=mtp, lr=1e-4))
    data = {"full": _full_rows, "packed": _packed_rows}[rows](2 * STEPS * micro_batch_size)
    try:
        trainer.fit(module, data)
    except Exception as error:  # a failure is this setting's result; the others still run
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        logger.removeHandler(handler)
    graph = strategy.cuda_graphs.graph
    return {"metrics": snapshot.metrics, "grads": gradients.steps, "steps": trainer.global_step,
            "graph": None if graph is None else graph.counts(),
            "stepped_aside": None if graph is None else graph.stepped_aside,
            "lines": [(record.levelno, record.getMessage()) for record in records]}


def _gpu_fits(root: str, checkpoint: str, out: str) -> None:
    """In a fresh process (NCCL, as a real single-GPU run): each case eager and auto; a failing capture each way."""
    from lightning_megatron.distributed import free_port, init_single_process

    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()
    results = {}
    for case in GPU_CASES:
        for cuda_graph in ("none", "auto"):
            results[f"{case}_{cuda_graph}"] = _gpu_fit(Path(root) / f"{case}_{cuda_graph}", checkpoint, case,
                                                       cuda_graph)
    for failure in ("raise", "sync"):
        results[f"fails_{failure}"] = _gpu_fit(Path(root) / f"fails_{failure}", checkpoint, "full_mtp", "auto",
                                               failure)
    torch.save(results, out)


# bf16's unit roundoff is u = 2^-8 ~ 3.9e-3. The graphed and eager runs compute the same sums with other kernels
# (flex_attention against cuDNN SDPA for full rows, other fusions and orders): each side rounds its bf16
# activations, gradients and reductions independently, a few u apart per value over the tiny model's two layers.
# 2e-2 (about 5u) bounds losses and grad norms relatively, and each gradient tensor elementwise at 5u of its
# largest entry (elements near zero have no meaningful relative error). A lost or doubled step's gradient moves
# the grad norm by 100%, far outside it. Each gradient is compared elementwise at the first step only, where both
# runs hold the same weights: Adam turns any rounding difference of a gradient into an update of about lr (1e-4)
# per weight, so from the second step on the two runs' weights differ by up to a few lr each, and a gradient that
# sums many cancelling terms (a q/k layernorm weight's, on the H200 on 2026-12-05) can then move by more than 5u of
# its largest entry without anything being wrong; losses and grad norms stay compared at every step.
BF16_RTOL = 2e-2


def _assert_trains_like_eager(got: dict[str, Any], eager: dict[str, Any], name: str) -> None:
    assert got["steps"] == eager["steps"] == STEPS, name
    assert len(got["metrics"]) == len(eager["metrics"]) == STEPS, name
    for step, (metrics, expected) in enumerate(zip(got["metrics"], eager["metrics"], strict=True)):
        assert metrics.keys() == expected.keys(), name
        for key in ("lm_loss", "mtp_loss", "grad_norm"):
            if key in expected:
                assert metrics[key] == pytest.approx(expected[key], rel=BF16_RTOL), (name, step, key)
    assert len(got["grads"]) == len(eager["grads"]) > 0, name
    for step, (grads, expected) in enumerate(zip(got["grads"], eager["grads"], strict=True)):
        assert grads.keys() == expected.keys(), name
        if step > 0:  # other weights from here on (see BF16_RTOL)
            continue
        for parameter, grad in expected.items():
            torch.testing.assert_close(grads[parameter], grad, rtol=BF16_RTOL,
                                       atol=BF16_RTOL * float(grad.abs().max()), msg=f"{name} {step} {parameter}")


@pytest.mark.gpu
def test_auto_trains_dense_packed_and_mtp_joint_like_eager_and_survives_a_failed_capture(checkpoint, tmp_path):
    """bf16 tiny Qwen3(+MTP), 4 optimizer steps of 2 microbatches at PP=1: auto graphs dense full rows, packed
    rows and joint MTP training (warm-up, one capture, two replays) and equals eager to bf16 (losses and grad norms
    of every step, every gradient of the first: see BF16_RTOL), saying so in one line. A capture failing by a Python
    error or by a host read falls back: one warning with the cause, no capture kept, the rest eager, the same steps
    and values as eager."""
    results = run_in_fresh_process(_gpu_fits, tmp_path, str(tmp_path), str(checkpoint))
    failures = {name: result["error"] for name, result in results.items() if "error" in result}
    assert not failures, failures
    for case in GPU_CASES:
        eager, auto = results[f"{case}_none"], results[f"{case}_auto"]
        assert eager["graph"] is None and eager["lines"] == [], case
        assert auto["graph"] == {"warmups": 1, "captures": 1, "replays": STEPS - 2, "eager": 0}, case
        assert auto["lines"] == [(logging.INFO, AUTO_GRAPHED)], case
        _assert_trains_like_eager(auto, eager, case)
    for failure in ("raise", "sync"):
        fell_back = results[f"fails_{failure}"]
        assert fell_back["graph"] == {"warmups": 1, "captures": 0, "replays": 0, "eager": STEPS - 1}, failure
        assert fell_back["stepped_aside"].startswith("the capture failed: "), failure
        (said, (level, warning)) = fell_back["lines"]
        assert said == (logging.INFO, AUTO_GRAPHED) and level == logging.WARNING, failure
        assert warning.startswith("cuda_graph auto: the CUDA graph's capture of the training step failed ("), warning
        if failure == "raise":
            assert "injected failure inside the capture" in warning
        _assert_trains_like_eager(fell_back, results["full_mtp_none"], failure)


@pytest.mark.gpu
def test_checkpointed_rng_states_are_tensors_under_the_graph_safe_tracker(model_parallel, tmp_path):
    """The strategy seeds Megatron's graph-safe tracker when the graph may come (auto on a GPU): its states are
    generators, written as tensors (a weights-only load reads them), and read back by either tracker, which then
    draw the numbers the saved one would have drawn."""
    from megatron.core import tensor_parallel

    from lightning_megatron.checkpoint import _rng_states, _set_rng_states

    def draw() -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.rand(8, device="cuda")

    try:
        for graph_safe in (True, False):  # each tracker writes the same file and reads it back
            tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True,
                                                            use_cudagraphable_rng=graph_safe)
            torch.save(_rng_states(), tmp_path / f"rng_{graph_safe}.pt")
            states = torch.load(tmp_path / f"rng_{graph_safe}.pt", weights_only=True)
            assert all(isinstance(state, torch.Tensor) for state in states["megatron"].values())
            expected = draw()
            for reader in (True, False):
                tensor_parallel.model_parallel_cuda_manual_seed(99, force_reset_rng=True,
                                                                use_cudagraphable_rng=reader)
                _set_rng_states(states)
                assert torch.equal(draw(), expected), (graph_safe, reader)
        assert torch.equal(*(torch.load(tmp_path / f"rng_{safe}.pt", weights_only=True)["megatron"]
                             ["model-parallel-rng"] for safe in (True, False)))
    finally:
        tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
