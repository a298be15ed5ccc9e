"""Train only the MTP head of an already fine-tuned model, and prove the rest did not move.

In `setup` (the model exists: the strategy built it in `setup_environment`; Megatron DDP and the optimizer do not,
so they only ever see the MTP parameters) every non-MTP parameter is frozen, shared embeddings and output
projection included. The main SFT loss stays in the graph (and is logged as `lm_loss`): Megatron-Core's MTP loss
backward hangs off it; by default its values are computed only on the steps that log them and its own backward is
skipped (`mtp.skip_main_head`); on a GPU the frozen trunk's forward is replayed from CUDA graphs
(`cuda_graphs.frozen_trunk`). At the end of fit an audit compares a checksum of every frozen tensor with its
value when training started (after the wrap and any checkpoint restore, before the first step; no copy of the
weights is kept) and writes the result as JSON; a frozen tensor that changed fails the run.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_megatron.bridges import capable_backends
from lightning_megatron.contract import MegatronLightningModule, logs_this_step
from lightning_megatron.cuda_graphs.frozen_trunk import graph_frozen_trunk
from lightning_megatron.cuda_graphs.options import CudaGraphOptions
from lightning_megatron.cuda_graphs.refusals import Setting, check_setting
from lightning_megatron.mtp.chunked_cross_entropy import DEFAULT_CHUNK_TOKENS
from lightning_megatron.mtp.parameters import freeze_non_mtp_parameters, mtp_parameter_flags
from lightning_megatron.mtp.skip_main_head import MainLossOnDemand, skip_main_lm_head_backward
from lightning_megatron.mtp.trunk_cache import TrunkCache, close_trunk_cache, open_trunk_cache

if TYPE_CHECKING:
    from lightning_megatron.cuda_graphs.graphed_forward import GraphedForward
    from lightning_megatron.strategy import MegatronStrategy


class MTPOnlyCallback(pl.Callback):
    """Freeze all but the MTP layer before Megatron wraps the model; audit the frozen weights at the end of fit.

    Args:
        audit_path: where the JSON audit goes (default: `<default_root_dir>/mtp_only_audit.json`).
        skip_main_head_backward: (default true) the main LM head reads detached hidden states and its loss is tied back
            to them with a zero gradient, so the backward skips the main cross-entropy and the LM head's input gradient
            over the whole vocabulary (and the main logits are freed after the forward), while `lm_loss`, the MTP
            gradients and the frozen weights are the same as without it. Set it to false to run the main loss's backward
            as plain Megatron-Core does (e.g. to compare, or if a megatron-core upgrade changes the call pattern the
            hooks check, which they report as an error).
        loss_chunk_tokens: (with `skip_main_head_backward`) both heads' cross-entropies run that many tokens at a time,
            so no `[tokens, vocab]` fp32 tensor outlives a chunk and the main logits never exist whole
            (`mtp.skip_main_head`); the logged values and gradients are the same to fp32 rounding. None: whole logits,
            as before.
        log_lm_loss_every_n_steps: (with `loss_chunk_tokens`) the main head (output layer and cross-entropy, about 14%
            of a 0.6B MTP-only step) runs only every n-th optimizer step (`(global_step + 1) % n == 0`, Lightning's own
            rule for `log_every_n_steps`) and always in validation; the other steps skip it and log no `lm_loss`, with
            the same `mtp_loss`, `mtp_accuracy` and MTP gradients. Default (null): the trainer's `log_every_n_steps`,
            the steps whose metrics reach the loggers; 1: every step. It must divide `log_every_n_steps`: Lightning
            sends a logger the last value of a metric a step did not log, so every logged step must compute it. In
            between, `trainer.callback_metrics["lm_loss"]` (progress bar, callbacks) keeps the last computed value. With
            whole logits the main head runs every step.
        trunk_cache_dir: train later epochs from a cache of the frozen trunk's output in that folder (`mtp.trunk_cache`:
            the first pass over a sample writes the decoder's hidden states, later ones skip the trunk; the main head
            runs on them when `lm_loss` is logged); refused, naming both, when the frozen weights or the training data
            differ from the cache's. For multi-epoch training on fixed data; leave it null while the trunk changes (e.g.
            during RL).
        cuda_graph_trunk: replay the frozen trunk's forward (every decoder layer and the final norm) from CUDA graphs,
            one per input shape, instead of launching its kernels (over a thousand per microbatch at 28 layers) one by
            one from the host (`cuda_graphs.frozen_trunk`; the same values). Null (auto): on where it applies: the model
            on a CUDA device, full or padded rows, no tensor, context or sequence parallelism, the first pipeline stage
            (the `cuda_graphs.refusals` table lists the rest); elsewhere, and for inputs it does not cover (packed or
            tree rows), the trunk runs eagerly, logged once. True: the same, but a CPU run is refused and chunks left
            eager are warned about; false: always eager. The strategy's whole-iteration graph does not serve MTP-only
            training: its `cuda_graph: auto` (the default) leaves the steps eager around these trunk graphs, saying so
            once; `cuda_graph: full_iteration` is refused.
    """

    def __init__(self, audit_path: str | None = None, skip_main_head_backward: bool = True,
                 loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, log_lm_loss_every_n_steps: int | None = None,
                 trunk_cache_dir: str | None = None, cuda_graph_trunk: bool | None = None) -> None:
        if loss_chunk_tokens is not None and loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens: {loss_chunk_tokens} must be at least 1 (or null for whole logits)")
        if log_lm_loss_every_n_steps is not None and log_lm_loss_every_n_steps < 1:
            raise ValueError(f"log_lm_loss_every_n_steps: {log_lm_loss_every_n_steps} must be at least 1 (or null "
                             "for the trainer's log_every_n_steps)")
        if trunk_cache_dir is not None and not (skip_main_head_backward and loss_chunk_tokens is not None):
            raise ValueError("trunk_cache_dir needs skip_main_head_backward: true and loss_chunk_tokens set (the "
                             "cached steps run the chunked main head on the cached hidden states when lm_loss is "
                             "logged); set them, or trunk_cache_dir: null")
        self.log_lm_loss_every_n_steps = log_lm_loss_every_n_steps
        self._main_loss = MainLossOnDemand()
        self.audit_path = audit_path
        self.skip_main_head_backward = skip_main_head_backward
        self.loss_chunk_tokens = loss_chunk_tokens
        self.trunk_cache_dir = trunk_cache_dir
        self.trunk_cache: TrunkCache | None = None
        # joined to the strategy's options in validate_megatron_setup
        self.cuda_graph_options = CudaGraphOptions.parse(cuda_graph_trunk=cuda_graph_trunk)
        self.trunk_graphs: list[GraphedForward] = []  # kept after fit: their counts stay readable
        self.trainable: list[str] = []
        self._frozen_checksums: dict[str, tuple[int, int]] = {}
        self._hook_handles: list[Any] = []

    def validate_megatron_setup(self, strategy: MegatronStrategy, module: MegatronLightningModule) -> None:
        """Called by MegatronStrategy before the model is built, so a bad combination costs no weight loading."""
        # the run's CUDA graph options: the strategy's, with this callback's cuda_graph_trunk
        self.cuda_graph_options = replace(strategy.cuda_graphs.options,
                                          frozen_trunk=self.cuda_graph_options.frozen_trunk)
        strategy.cuda_graphs.check_mtp_only()  # cuda_graph: full_iteration is refused; auto steps aside
        bridge = strategy.bridge
        if not bridge.supports_mtp_training:
            capable = capable_backends(lambda backend: backend.supports_mtp_training)
            raise ValueError(f"MTPOnlyCallback needs bridge_type: {capable} (got {bridge.name!r}; "
                             f"{bridge.name} cannot build MTP heads)")
        if not module.enable_mtp_training:
            raise ValueError("MTPOnlyCallback trains the MTP head: set SFTModule(enable_mtp=True) "
                             "(enable_mtp_training then defaults to true)")
        check_setting(Setting(self.cuda_graph_options, device=strategy.root_device, mtp_only=True))
        every, logged_every = self.log_lm_loss_every_n_steps, module.trainer.log_every_n_steps
        if every is not None and logged_every % every:
            raise ValueError(f"log_lm_loss_every_n_steps: {every} must divide the trainer's log_every_n_steps "
                             f"({logged_every}), so that every step a logger records computes lm_loss; to log it less "
                             "often raise log_every_n_steps, or leave log_lm_loss_every_n_steps null")
        if bridge.router_updates_expert_bias(module.model_options()):
            raise ValueError("MTPOnlyCallback cannot freeze a model whose MoE router updates its expert bias every "
                             "step (moe_router_enable_expert_bias with moe_router_bias_update_rate > 0): set "
                             "config_overrides.moe_router_bias_update_rate: 0 to keep the bias as loaded (what "
                             "GLM-4.5 checkpoints get by default), or moe_router_enable_expert_bias: false for a "
                             "checkpoint without one, or train jointly")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from megatron.core import parallel_state

        chunks = list(pl_module.model)
        last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.trainable = freeze_non_mtp_parameters(chunks, allow_missing_mtp=not last_stage)
        if self.skip_main_head_backward:
            self._hook_handles = skip_main_lm_head_backward(chunks, chunk_tokens=self.loss_chunk_tokens,
                                                            on_demand=self._main_loss)
        self.trunk_graphs = graph_frozen_trunk(chunks, self.cuda_graph_options)

    @property
    def main_head_runs(self) -> bool:
        """Whether the training step in flight runs the main head (false only on a step that skips it)."""
        return self._main_loss.compute or not (self.skip_main_head_backward and self.loss_chunk_tokens is not None)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The reference checksums: after the wrap (bf16 casts the norm weights the model was built with in fp32)
        and any checkpoint restore, before the first step."""
        self._frozen_checksums = _frozen_checksums(pl_module)
        if self.trunk_cache_dir is not None:
            self.trunk_cache = open_trunk_cache(self.trunk_cache_dir, pl_module, trainer.train_dataloader,
                                                self._frozen_checksums)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The main head runs in the steps the loggers record (`logs_this_step`), or every
        `log_lm_loss_every_n_steps`."""
        self._main_loss.compute = logs_this_step(trainer, self.log_lm_loss_every_n_steps)
        if self.trunk_cache is not None:
            self.trunk_cache.plan_step(batch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.trunk_cache is not None:
            self.trunk_cache.end_step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.trunk_cache is not None:
            self.trunk_cache.finish()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._main_loss.compute = True
        if self.trunk_cache is not None:
            self.trunk_cache.close()  # kept: its counts (`reads`, `writes_done`) stay readable
            close_trunk_cache(pl_module)
        for handle in [*self._hook_handles, *self.trunk_graphs]:
            handle.remove()
        self._hook_handles = []

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flags = mtp_parameter_flags(_unwrapped(pl_module))
        # no reference when training never started (resumed at max_steps): no step ran, nothing changed
        reference = self._frozen_checksums or _frozen_checksums(pl_module)
        changed = [name for name, parameter, is_mtp in flags.values()
                   if not is_mtp and checksum(parameter) != reference[name]]
        counts = torch.tensor([
            _unique_numel(parameter for _, parameter, is_mtp in flags.values() if is_mtp),
            _unique_numel(parameter for _, parameter, is_mtp in flags.values() if not is_mtp),
            len(changed),
        ], dtype=torch.float64, device=trainer.strategy.root_device)
        _sum_over_model_parallel_ranks(counts)
        audit = {
            "trainable_parameters": int(counts[0]),
            "frozen_parameters": int(counts[1]),
            "frozen_tensors_changed": int(counts[2]),
            "frozen_bit_identical": int(counts[2]) == 0,
            "trainable_tensors_on_rank_0": self.trainable,
            "changed_tensors_on_this_rank": changed,
        }
        path = Path(self.audit_path or Path(trainer.default_root_dir) / "mtp_only_audit.json")
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(audit, indent=2) + "\n")
        if counts[2]:
            raise RuntimeError(f"MTPOnlyCallback: {int(counts[2])} frozen tensor(s) changed during fit, e.g. "
                               f"{changed[:5]}; see {path}")


def _unwrapped(pl_module: pl.LightningModule) -> list[torch.nn.Module]:
    from megatron.core.utils import unwrap_model

    return [unwrap_model(chunk) for chunk in pl_module.model]


def _frozen_checksums(pl_module: pl.LightningModule) -> dict[str, tuple[int, int]]:
    return {name: checksum(parameter)
            for name, parameter, is_mtp in mtp_parameter_flags(_unwrapped(pl_module)).values() if not is_mtp}


CHECKSUM_CHUNK_ELEMENTS = 1 << 24


def checksum(tensor: torch.Tensor, chunk_elements: int = CHECKSUM_CHUNK_ELEMENTS) -> tuple[int, int]:
    """An exact, order-sensitive checksum of a tensor's bits, computed where the tensor lives.

    In chunks of `chunk_elements`, so its int64 temporaries stay bounded (three of them for a whole [151936, 4096]
    embedding would be 14 GiB); int64 sums wrap modulo 2**64 the same chunked or not, so the value does not depend
    on the chunk size."""
    flat = tensor.detach().contiguous().view(-1)
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    plain = torch.zeros((), dtype=torch.int64, device=bits.device)
    weighted = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), chunk_elements):
        chunk = bits[start:start + chunk_elements].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=bits.device, dtype=torch.int64) % 1_000_003 + 1
        plain += chunk.sum()
        weighted += (chunk * weights).sum()
    return int(plain), int(weighted)


def _unique_numel(parameters: Any) -> int:
    """Elements this rank owns: a tensor-parallel-replicated parameter counts on TP rank 0 only."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return sum(p.numel() for p in parameters if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)


def _sum_over_model_parallel_ranks(values: torch.Tensor) -> None:
    from megatron.core import parallel_state

    dist.all_reduce(values, group=parallel_state.get_model_parallel_group())
