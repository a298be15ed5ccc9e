"""`MegatronStrategy(cuda_graph="full_iteration")`: the CUDA-graph options object, what the refusal table refuses
(each row's reason and fix), that the fixed `cu_seqlens` count it pads packed rows to changes no loss and no
gradient (the part of the graph path the CPU can check), and on a GPU that a tiny Qwen3+MTP trains packed and full
rows through the captured graph as it does eagerly (captured once, replayed without a host sync)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron.cuda_graphs.full_iteration import FullIterationGraph
from lightning_megatron.cuda_graphs.options import CudaGraphOptions, IterationGraph, TrunkGraphs
from lightning_megatron.cuda_graphs.refusals import Mechanism, Setting, check_setting, reason
from lightning_megatron.distributed import ParallelSizes
from lightning_megatron.microbatch import with_fixed_sequence_count
from lightning_megatron.module import SFTModule
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_in_fresh_process
from tests._megatron import VOCAB

ROW, STEPS = 128, 4  # 2 microbatches a step: warm-up, capture, 2 replays


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("full_graph") / "qwen3_mtp", "qwen3", mtp=True)


def test_the_options_are_parsed_once_into_one_frozen_object():
    from lightning_megatron.callbacks import MTPOnlyCallback

    assert CudaGraphOptions.parse() == CudaGraphOptions(IterationGraph.AUTO, 256, TrunkGraphs.AUTO)
    assert CudaGraphOptions.parse("none").full_iteration is IterationGraph.OFF
    options = CudaGraphOptions.parse("full_iteration", 16, cuda_graph_trunk=False)
    assert options == CudaGraphOptions(full_iteration=IterationGraph.REQUIRED, sequences_per_row=16,
                                       frozen_trunk=TrunkGraphs.OFF)
    assert CudaGraphOptions.parse(cuda_graph_trunk=True).frozen_trunk is TrunkGraphs.REQUIRED
    assert CudaGraphOptions.parse("none", 0).sequences_per_row == 0  # only the graph reads it
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.full_iteration = IterationGraph.OFF  # type: ignore[misc]
    strategy = MegatronStrategy(hf_checkpoint="unused", cuda_graph="full_iteration", cuda_graph_sequences_per_row=8)
    assert strategy.cuda_graphs.options == CudaGraphOptions(full_iteration=IterationGraph.REQUIRED, sequences_per_row=8)
    assert MTPOnlyCallback(cuda_graph_trunk=False).cuda_graph_options.frozen_trunk is TrunkGraphs.OFF


def test_the_options_keep_their_names_types_and_defaults():
    """LightningCLI reads these signatures' type hints; configs and user code name the parameters."""
    from lightning_megatron.callbacks import MTPOnlyCallback

    hints = typing.get_type_hints(MegatronStrategy.__init__)
    assert hints["cuda_graph"] == Literal["auto", "none", "full_iteration"]
    assert hints["cuda_graph_sequences_per_row"] is int
    parameters = inspect.signature(MegatronStrategy).parameters
    assert (parameters["cuda_graph"].default, parameters["cuda_graph_sequences_per_row"].default) == ("auto", 256)
    assert typing.get_type_hints(MTPOnlyCallback.__init__)["cuda_graph_trunk"] == bool | None
    assert inspect.signature(MTPOnlyCallback).parameters["cuda_graph_trunk"].default is None


FULL = CudaGraphOptions(full_iteration=IterationGraph.REQUIRED)
CPU = torch.device("cpu")


@pytest.mark.parametrize(("setting", "message"), [
    (Setting(FULL, ParallelSizes(pipeline=2)), "cuda_graph: full_iteration needs pipeline_model_parallel_size: 1, "
     "got 2 (the pipeline schedule is not captured); set cuda_graph: none"),
    (Setting(FULL, ParallelSizes(context=2)), "cuda_graph: full_iteration needs context_parallel_size: 1, got 2 "
     "(the CP cut reads cu_seqlens on the host in the step); set cuda_graph: none"),
    (Setting(FULL, ParallelSizes(expert=4)), "cuda_graph: full_iteration needs expert_model_parallel_size: 1, got 4 "
     "(MoE routing has data-dependent shapes); set cuda_graph: none"),
    (Setting(FULL, device=CPU), "cuda_graph: full_iteration needs the model on a CUDA device, got cpu; set "
     "cuda_graph: none (or train on a GPU)"),
    (Setting(FULL, mtp_only=True), "cuda_graph: full_iteration does not serve MTPOnlyCallback (it decides in Python, "
     "step by step, whether the main head runs; replays would repeat one choice); set the strategy's cuda_graph: none "
     "(MTPOnlyCallback's cuda_graph_trunk graphs the frozen trunk)"),
    (Setting(CudaGraphOptions(frozen_trunk=TrunkGraphs.REQUIRED), device=CPU, mtp_only=True),
     "cuda_graph_trunk: true needs the model on a CUDA device (this run's is cpu); set cuda_graph_trunk: null (on "
     "where it applies) or false"),
], ids=["pipeline", "context", "experts", "cpu", "mtp_only", "trunk_on_cpu"])
def test_each_refusal_of_the_options_names_the_option_and_the_fix(setting, message):
    with pytest.raises(ValueError) as raised:
        check_setting(setting)
    assert str(raised.value) == message


@pytest.mark.parametrize("setting", [
    Setting(CudaGraphOptions(IterationGraph.OFF), ParallelSizes(pipeline=2, context=2, expert=2), CPU, mtp_only=True),
    Setting(CudaGraphOptions(), ParallelSizes(pipeline=2, context=2, expert=2), CPU, processes=8, mtp_only=True),
    Setting(CudaGraphOptions(IterationGraph.OFF, frozen_trunk=TrunkGraphs.OFF), device=CPU, mtp_only=True),
    Setting(FULL, ParallelSizes(tensor=2, data=4), torch.device("cuda", 0)),
    Setting(FULL),
], ids=["nothing_asked", "auto_steps_aside", "trunk_off", "one_gpu_per_replica", "nothing_known_yet"])
def test_what_the_options_can_serve_is_not_refused(setting):
    check_setting(setting)


def test_the_whole_iteration_graph_refuses_moe_models_and_other_attention_cores(model_parallel):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.test_attention import _config, _tiny_mtp_gpt

    model = _tiny_mtp_gpt()
    assert reason(Mechanism.FULL_ITERATION, model) is None
    local = GPTModel(_config(), get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=ROW)
    with pytest.raises(ValueError, match=re.escape(
            "cuda_graph: full_iteration needs the SDPAttention core (attention_backend: sdpa, or auto without "
            "Transformer Engine); set cuda_graph: none or attention_backend: sdpa")):
        FullIterationGraph([local], sequences_per_row=4)
    model.config.num_moe_experts = 2  # what a MoE model's config says
    with pytest.raises(ValueError, match=re.escape(
            "cuda_graph: full_iteration does not serve Mixture of Experts models (token routing has data-dependent "
            "shapes); set cuda_graph: none")):
        FullIterationGraph([model], sequences_per_row=4)


@pytest.mark.parametrize(("options", "message"), [
    (dict(cuda_graph="whole"), "cuda_graph: 'whole' is not one of 'auto', 'none', 'full_iteration'"),
    (dict(cuda_graph_sequences_per_row=0), "cuda_graph_sequences_per_row: 0 must be a positive integer"),
    # not a count: refused whatever cuda_graph says, before the run (a float would reach the packed rows' padding)
    (dict(cuda_graph="auto", cuda_graph_sequences_per_row=2.5), "cuda_graph_sequences_per_row: 2.5 must be a"),
    (dict(cuda_graph="none", cuda_graph_sequences_per_row=True), "cuda_graph_sequences_per_row: True must be a"),
    (dict(pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size: 1, got 2"),
    (dict(context_parallel_size=2), "needs context_parallel_size: 1, got 2"),
    (dict(expert_model_parallel_size=2), "needs expert_model_parallel_size: 1, got 2"),
], ids=["unknown", "no_sequences", "fractional_sequences", "bool_sequences", "pipeline", "context", "experts"])
def test_what_the_full_iteration_graph_cannot_serve_is_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(hf_checkpoint="unused", **{"cuda_graph": "full_iteration", **options})


def test_mtp_only_training_refuses_the_full_iteration_graph():
    from lightning_megatron.callbacks import MTPOnlyCallback

    strategy = MegatronStrategy(hf_checkpoint="unused", cuda_graph="full_iteration")
    with pytest.raises(ValueError, match="cuda_graph: full_iteration does not serve MTPOnlyCallback"):
        MTPOnlyCallback().validate_megatron_setup(strategy, SFTModule(enable_mtp=True))


def test_the_full_iteration_graph_on_the_cpu_is_refused(process_group, checkpoint, tmp_path):
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(checkpoint), cuda_graph="full_iteration"),
                         accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="cuda_graph: full_iteration needs the model on a CUDA device, got cpu"):
        trainer.fit(SFTModule(enable_mtp=True), _packed_rows(2))


def test_a_fixed_sequence_count_changes_no_loss_and_no_gradient(model_parallel):
    """A packed row through a local-spec GPT with its MTP layer (CPU: dense-mask SDPA, THD RoPE, MTP rolls), with
    `cu_seqlens` as packed and as the graph path pads it (16 sequences, `max_seqlen` the row length - 1): per-token
    losses and every gradient equal (fp32, 1e-6). Tree rows are refused, rows the fixed shapes cannot hold kept."""
    from tests._compat.test_packed import PACKED_LENGTHS, packed_row
    from tests.test_attention import _per_token_loss_and_grads, _tiny_mtp_gpt

    row = sum(PACKED_LENGTHS)
    microbatch = {**packed_row(), "max_seqlen": max(PACKED_LENGTHS)}
    model = _tiny_mtp_gpt()
    graph = FullIterationGraph([model], sequences_per_row=16)
    (padded,) = graph.static_microbatches([microbatch])
    assert padded["cu_seqlens"].tolist() == microbatch["cu_seqlens"].tolist() + [row] * 10
    assert padded["max_seqlen"] == row - 1
    expected_loss, expected_grads = _per_token_loss_and_grads(model, microbatch)
    loss, grads = _per_token_loss_and_grads(model, padded)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    assert any(name.startswith("mtp.") for name in grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)
    too_many = with_fixed_sequence_count(microbatch, 6, row - 1)  # 6 sequences fit 6 exactly
    assert len(too_many["cu_seqlens"]) == 7
    with pytest.raises(ValueError, match="cu_seqlens: 6 sequences in the row, more than the fixed count 5"):
        with_fixed_sequence_count(microbatch, 5, row - 1)
    whole = {**microbatch, "cu_seqlens": torch.tensor([0, row], dtype=torch.int32), "max_seqlen": row}
    assert graph.static_microbatches([whole])[0] is whole  # one sequence fills the row: eager, as it is
    with pytest.raises(ValueError, match="does not serve tree rows"):
        graph.static_microbatches([{"input_ids": microbatch["input_ids"], "subtree_end": torch.full((1, row), row)}])


def _packed_rows(count: int) -> DataLoader:
    """`count` packed rows of `ROW` tokens made by the data pipeline (a Python int `max_seqlen`), in order."""
    from lightning_megatron.data.packing import collate_packed, first_fit, pack_examples
    from lightning_megatron.data.tokenize import TokenizedExample

    generator = torch.Generator().manual_seed(0)
    examples = [TokenizedExample(f"s:{i}", torch.randint(0, VOCAB, (int(n),), generator=generator),
                                 torch.rand(int(n), generator=generator) < 0.7)
                for i, n in enumerate(torch.randint(8, 60, (8 * count,), generator=generator))]
    bins = first_fit([len(e) for e in examples], ROW)[:count]
    rows = [pack_examples([examples[i] for i in members], ROW, pad_id=0) for members in bins]
    return DataLoader(rows, batch_size=1, collate_fn=collate_packed)  # as SFTDataModule(packing=True) loads them


def _full_rows(count: int) -> DataLoader:
    from lightning_megatron.testing.datasets import RandomTokenDataset

    return DataLoader(RandomTokenDataset(count, ROW, VOCAB), batch_size=2)


def _gpu_fits(root: str, checkpoint: str, out: str) -> None:
    """In a fresh process (NCCL, as a real single-GPU run): eager and graphed fits of packed and full rows; every
    replayed step under `set_sync_debug_mode("error")`."""
    from lightning_megatron.distributed import free_port, init_single_process
    from tests.mtp._helpers import Snapshot

    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()
    checked = []
    run = FullIterationGraph.run

    def run_checked(graph: FullIterationGraph, *args: Any, **kwargs: Any) -> list:
        if not graph.captures:
            return run(graph, *args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(graph, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            checked.append(graph.counts()["replays"])

    FullIterationGraph.run = run_checked
    results: dict[str, Any] = {}
    for rows, micro_batch_size, data in (("packed", 1, _packed_rows), ("full", 2, _full_rows)):
        for cuda_graph in ("none", "full_iteration"):
            name = f"{rows}_{cuda_graph}"
            snapshot = Snapshot()
            strategy = MegatronStrategy(hf_checkpoint=checkpoint, bridge_type="megatron-bridge",
                                        micro_batch_size=micro_batch_size, global_batch_size=2 * micro_batch_size,
                                        cuda_graph=cuda_graph)
            trainer = pl.Trainer(strategy=strategy, accelerator="gpu", devices=1, max_steps=STEPS,
                                 log_every_n_steps=1, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False,
                                 default_root_dir=Path(root) / name, callbacks=[snapshot])
            try:
                trainer.fit(SFTModule(enable_mtp=True, lr=1e-4), data(2 * STEPS * micro_batch_size))
                graph = strategy.cuda_graphs.graph
                results[name] = {"metrics": snapshot.metrics, "after": {k: v.cpu() for k, v in snapshot.after.items()},
                                 "graph": None if graph is None else graph.counts()}
            except Exception as error:  # a failure is this setting's result; the others still run
                results[name] = {"error": f"{type(error).__name__}: {error}"}
    results["checked"] = checked
    torch.save(results, out)


@pytest.mark.gpu
def test_the_full_iteration_graph_trains_like_eager_for_packed_and_full_rows(checkpoint, tmp_path):
    """bf16 tiny Qwen3+MTP, 4 optimizer steps of 2 microbatches, packed and full rows: the graphed run equals the
    eager run to bf16 tolerance (losses, grad norms, weights; full rows: flex_attention against eager cuDNN SDPA),
    warm-up, one capture, two replays, each free of host syncs. Not covered on one GPU: CP chunks (CP > 1 is
    refused)."""
    results = run_in_fresh_process(_gpu_fits, tmp_path, str(tmp_path), str(checkpoint))
    failures = {name: result["error"] for name, result in results.items() if isinstance(result, dict)
                and "error" in result}
    assert not failures, failures
    for rows in ("packed", "full"):
        eager, graph = results[f"{rows}_none"], results[f"{rows}_full_iteration"]
        assert eager["graph"] is None
        assert graph["graph"] == {"warmups": 1, "captures": 1, "replays": STEPS - 2, "eager": 0}, rows
        assert len(graph["metrics"]) == len(eager["metrics"]) == STEPS
        for step, (got, expected) in enumerate(zip(graph["metrics"], eager["metrics"], strict=True)):
            for key in ("lm_loss", "mtp_loss", "grad_norm"):
                assert got[key] == pytest.approx(expected[key], rel=2e-2), (rows, step, key)
        # a bound whatever the gradients' rounding: each Adam step moves a weight by at most about lr, so two runs of
        # STEPS steps at lr 1e-4 differ by at most 2 * STEPS * 1e-4 = 8e-4 (< atol), plus bf16's rounding (rtol)
        for name, value in eager["after"].items():
            torch.testing.assert_close(graph["after"][name].float(), value.float(), rtol=2e-2, atol=2e-3,
                                       msg=f"{rows}: {name}")
    assert results["checked"] == [1, 2, 1, 2]  # each run's two replays, each under the sync check
