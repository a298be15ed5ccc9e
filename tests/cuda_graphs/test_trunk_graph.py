"""The frozen trunk replayed from CUDA graphs in MTP-only training (`cuda_graphs.frozen_trunk`, `graphed_forward`).

On a GPU, a tiny Qwen3+MTP model in bf16, two epochs of MTP-only steps: with the graph, every logged metric
(`mtp_loss`, `mtp_accuracy`, `lm_loss`, ...), every step's MTP gradients and the final MTP weights equal the eager
run's bit for bit (a replay runs the kernels the eager forward ran, on the same inputs), with and without the trunk
cache; the graph is captured once and replayed for every later microbatch, and a replayed trunk makes no host sync.
The same for a MoE trunk (tiny Qwen3-MoE), but for its frozen routers' load-balancing loss, which a replay leaves out.
On the CPU: auto leaves the run eager (tests/mtp/test_trunk_cache.py), an explicit true is refused naming the
option, and each row of the refusal table that leaves a chunk's trunk or a decoder call eager gives its reason
(logged).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron.cuda_graphs.frozen_trunk import graph_frozen_trunk
from lightning_megatron.cuda_graphs.options import CudaGraphOptions, TrunkGraphs
from lightning_megatron.cuda_graphs.refusals import REFUSALS, Mechanism, TrunkCall, reason
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_in_fresh_process
from tests.mtp.test_trunk_cache import _assert_equal_runs, _fit


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("trunk_graph") / "qwen3_mtp", "qwen3", mtp=True)


class NoHostSyncInReplays(pl.Callback):
    """From the second step on (the first warms up and captures), `set_sync_debug_mode("error")` around every
    decoder forward: a host sync inside a replayed trunk raises."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.checked = 0
        decoder = unwrap_model(pl_module.model[0]).decoder
        self._handles = [decoder.register_forward_pre_hook(lambda *_: self._enter(trainer)),
                         decoder.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode(0))]

    def _enter(self, trainer: pl.Trainer) -> None:
        if trainer.global_step >= 1:
            self.checked += 1
            torch.cuda.set_sync_debug_mode("error")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()


def _on_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_on_host(item) for item in value]
    return value


def _gpu_fits(root: str, checkpoint: str, out: str) -> None:
    """In a fresh process (NCCL, as a real single-GPU run; the test session's group is gloo): eager and graphed
    fits, each without and with the trunk cache."""
    from lightning_megatron.distributed import free_port, init_single_process

    os.environ["MASTER_PORT"] = str(free_port())  # not the test session's own gloo group's, inherited
    init_single_process()
    results, sync_check = {}, NoHostSyncInReplays()
    try:
        for cache in (False, True):
            for graph in (False, True):
                name = f"{'graph' if graph else 'eager'}_{'cache' if cache else 'plain'}"
                callbacks = (sync_check,) if graph and not cache else ()  # the cache's writer syncs on its thread
                results[name] = _fit(Path(root) / name, Path(checkpoint), cache=Path(root) / f"{name}_cache"
                                     if cache else None, accelerator="gpu", precision="bf16",
                                     cuda_graph_trunk=graph, callbacks=callbacks)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    results["sync_checked"] = sync_check.checked
    torch.save(_on_host(results), out)


@pytest.mark.gpu
def test_the_graphed_trunk_trains_exactly_like_eager_with_and_without_the_cache(checkpoint, tmp_path):
    results = run_in_fresh_process(_gpu_fits, tmp_path, str(tmp_path), str(checkpoint))
    for setting in ("plain", "cache"):
        eager, graph = results[f"eager_{setting}"], results[f"graph_{setting}"]
        assert eager["graphs"] == []
        _assert_equal_runs(graph, eager)
        for step, (graph_grads, eager_grads) in enumerate(zip(graph["mtp_grads"], eager["mtp_grads"], strict=True)):
            for name, value in graph_grads.items():
                assert torch.equal(value, eager_grads[name]), (setting, step, name)
    # 4 steps x 2 microbatches: the first call warms up, the second captures, the rest replay; in the cached run
    # only the first epoch (2 steps) runs the trunk
    assert results["graph_plain"]["graphs"] == [{"warmups": 1, "captures": 1, "replays": 6, "eager": {}}]
    assert results["graph_cache"]["graphs"] == [{"warmups": 1, "captures": 1, "replays": 2, "eager": {}}]
    assert results["graph_cache"]["cache"] == results["eager_cache"]["cache"] == {"written": 8, "read": 8}
    assert results["sync_checked"] == 6


def _gpu_moe_fits(root: str, checkpoint: str, out: str) -> None:
    """As `_gpu_fits` for a MoE model: eager and graphed MTP-only fits, no trunk cache."""
    from lightning_megatron.distributed import free_port, init_single_process

    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()
    results, sync_check = {}, NoHostSyncInReplays()
    try:
        for graph in (False, True):
            results["graph" if graph else "eager"] = _fit(
                Path(root) / str(graph), Path(checkpoint), cache=None, accelerator="gpu", precision="bf16",
                cuda_graph_trunk=graph, callbacks=(sync_check,) if graph else ())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    results["sync_checked"] = sync_check.checked
    torch.save(_on_host(results), out)


@pytest.mark.gpu
def test_a_moe_trunk_is_graphed_and_trains_exactly_like_eager(tmp_path):
    """A tiny Qwen3-MoE + MTP trunk (its routed experts grouped, their counts on the device) is captured once and
    replayed with no host sync; every logged metric of every step, every step's MTP gradients and the final MTP
    weights equal eager's bit for bit, but for `moe_aux_loss`: a replay records no load-balancing loss for the frozen
    trunk's routers (computed with grad enabled only), so it is the MTP layer's alone, at most eager's."""
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_moe_mtp", "qwen3_moe", mtp=True)
    results = run_in_fresh_process(_gpu_moe_fits, tmp_path, str(tmp_path), str(checkpoint))
    eager, graph = results["eager"], results["graph"]
    assert graph["graphs"] == [{"warmups": 1, "captures": 1, "replays": 6, "eager": {}}] and results["sync_checked"]
    balancing = {"moe_aux_loss"}  # `SFTModule`'s load-balancing loss of the routers
    assert any(balancing <= metrics.keys() for metrics in eager["metrics"])
    for graph_step, eager_step in zip(graph["metrics"], eager["metrics"], strict=True):
        assert {k: v for k, v in graph_step.items() if k not in balancing} == \
            {k: v for k, v in eager_step.items() if k not in balancing}
        assert all(graph_step[name] <= eager_step[name] for name in balancing & graph_step.keys())
    for name, value in graph["mtp"].items():
        assert torch.equal(value, eager["mtp"][name]), name
    for graph_grads, eager_grads in zip(graph["mtp_grads"], eager["mtp_grads"], strict=True):
        assert all(torch.equal(value, eager_grads[name]) for name, value in graph_grads.items())
    assert graph["audit"]["frozen_bit_identical"] and eager["audit"]["frozen_bit_identical"]


def test_an_explicit_cuda_graph_trunk_on_the_cpu_is_refused(process_group, checkpoint, tmp_path):
    with pytest.raises(ValueError, match="cuda_graph_trunk: true needs the model on a CUDA device"):
        _fit(tmp_path, checkpoint, cache=None, cuda_graph_trunk=True)


def _trunk_reasons(subject: object) -> list[str]:
    """Every frozen-trunk refusal that applies to `subject`, in table order (`reason` gives the first)."""
    return [row.message(subject) for row in REFUSALS if row.mechanism is Mechanism.FROZEN_TRUNK
            and isinstance(subject, row.subject) and row.applies(subject)]


def test_each_refusal_of_a_model_chunk_leaves_its_trunk_eager_with_its_reason(model_parallel):
    from tests.test_attention import _tiny_mtp_gpt

    assert reason(Mechanism.FROZEN_TRUNK, torch.nn.Linear(2, 2)) == "no decoder on this chunk"
    model = _tiny_mtp_gpt()
    assert _trunk_reasons(model) == ["the model is not on a CUDA device", "trainable decoder parameters"]
    for parameter in model.decoder.parameters():
        parameter.requires_grad_(False)
    config = model.config
    for field, value, expected in (
        ("tensor_model_parallel_size", 2, "tensor parallelism"),
        ("context_parallel_size", 2, "context parallelism"),
        ("sequence_parallel", True, "sequence parallelism"),
        ("recompute_granularity", "full", "recompute_granularity: full"),
        ("fp8", "hybrid", "FP8/FP4"),
        ("expert_model_parallel_size", 2, "expert parallelism (the MoE layers' all-to-all)"),
        ("cpu_offloading", True, "activation offloading"),
        ("cuda_graph_impl", "local", "Megatron-Core's own CUDA graphs (cuda_graph_impl)"),
    ):
        before = getattr(config, field)
        setattr(config, field, value)
        assert _trunk_reasons(model) == ["the model is not on a CUDA device", expected], field
        setattr(config, field, before)
    config.num_moe_experts = 2  # dropless routing on one rank is graphed; dropping or padding is not
    assert _trunk_reasons(model) == ["the model is not on a CUDA device"]
    config.moe_expert_capacity_factor = 1.0
    assert _trunk_reasons(model) == ["the model is not on a CUDA device",
                                     "MoE token dropping or padding (moe_expert_capacity_factor)"]
    config.num_moe_experts, config.moe_expert_capacity_factor = None, None
    model.decoder.pre_process = False
    assert _trunk_reasons(model) == ["the model is not on a CUDA device",
                                     "a later pipeline stage (its decoder reads the received input_tensor)"]


def test_each_refusal_of_a_decoder_call_runs_it_eagerly_with_its_reason(model_parallel):
    from megatron.core.packed_seq_params import PackedSeqParams

    from tests.test_attention import _tiny_mtp_gpt

    decoder = _tiny_mtp_gpt().decoder.eval()
    hidden = torch.zeros(4, 1, decoder.config.hidden_size)

    def call(**arguments: Any) -> str | None:
        return reason(Mechanism.FROZEN_TRUNK, TrunkCall(decoder, {"hidden_states": hidden, "attention_mask": None,
                                                                  **arguments}))

    assert call() is None
    assert call(packed_seq_params=PackedSeqParams(qkv_format="thd")) == "packed rows (packed_seq_params)"
    assert call(attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool)) == ("an attention mask (tree rows or an "
                                                                              "explicit mask)")
    for name in ("context", "context_mask", "attention_bias", "inference_context", "inference_params"):
        assert call(**{name: hidden}) == f"{name} given"
    assert call(extract_layer_indices=[0]) == "extract_layer_indices given"
    decoder.train()
    assert call() is None  # no dropout configured
    decoder.config.hidden_dropout = 0.1
    assert call() == "dropout while training"


def test_a_chunk_left_eager_is_logged_with_its_reason_and_warned_about_when_asked_for(model_parallel, caplog):
    from tests.test_attention import _tiny_mtp_gpt

    model = _tiny_mtp_gpt()
    with caplog.at_level(logging.INFO, logger="lightning_megatron.cuda_graphs.frozen_trunk"):
        for trunk in (TrunkGraphs.AUTO, TrunkGraphs.REQUIRED, TrunkGraphs.OFF):
            assert graph_frozen_trunk([model], CudaGraphOptions(frozen_trunk=trunk)) == []
    message = "cuda_graph_trunk: model chunk 0's trunk stays eager: the model is not on a CUDA device"
    logged = [(record.levelno, record.getMessage()) for record in caplog.records
              if record.name == graph_frozen_trunk.__module__]
    assert logged == [(logging.INFO, message), (logging.WARNING, message)]
