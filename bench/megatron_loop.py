"""The plain Megatron-Core training loop: what `MegatronStrategy` must reproduce, without Lightning.

Written the way Megatron-LM's `pretrain` loop is (parallel state, model from the HF checkpoint through the same
bridge, Float16Module, Megatron DDP, Megatron optimizer, `get_forward_backward_func`, token-weighted loss), so the
tests can compare Lightning's loss per step with it and the benchmarks can compare step times. Data order follows
`torch.utils.data.DistributedSampler` over the data-parallel ranks, shuffled with `sampler_seed`, as Lightning does.

`run` returns the loss of every step and its wall time, measured from one synchronised step end to the next
(fetching the microbatches, forward-backward, optimizer step, loss reduction: everything an iteration costs), which
is how `bench/lightning_overhead.py` times the Lightning fit it compares against. On a GPU the peak-memory counter
is reset when training starts (`setup_peak_memory_bytes`: the peak of building the model until then). `adam`: which
torch Adam each part of Megatron's optimizer steps with ("fused" on a GPU without TE/Apex: `prepare_megatron_core`
applies `_compat.fused_adam` here as the strategy does, so both loops step with the same Adam). With an MTP
head the MTP loss is read from Megatron-Core's tracker and the tracker cleaned every step, as Megatron-LM's
`training_log` does. `mtp_only`: the plain Megatron-Core MTP-only loop, every non-MTP parameter frozen
(`requires_grad=False`) before DDP and the optimizer exist and nothing else changed. `random_weights`: Megatron's
random initialization instead of the checkpoint's weights (a config-only checkpoint is enough). `lora`: LoRA
adapters on the frozen model before Float16Module and DDP, through the same megatron-bridge transform as
`LoRACallback`. `cuda_graph`: the step's forward-backward captured once and replayed, through the same
`FullIterationGraph` as `MegatronStrategy(cuda_graph="full_iteration")` (Megatron-Core's `FullCudaGraphWrapper`, the
graph-safe RNG tracker). `optimizer_offload_fraction`: Megatron-Core's optimizer CPU offload, as Megatron-LM's
`--optimizer-cpu-offload --optimizer-offload-fraction F --use-precision-aware-optimizer` ask for it.
Packed rows (a `collate_fn` making THD microbatches with `cu_seqlens`) reach the model as Megatron-Core's
`PackedSeqParams`. A run that fails releases its model (`common.release_model`) before the error goes on.

Run as a script (`python -m bench.megatron_loop`): prints JSON with the loss and time of every step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

if TYPE_CHECKING:
    from lightning_megatron.lora import LoRAConfig


@dataclass
class LoopConfig:
    hf_checkpoint: str
    bridge_type: str = "mbridge"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    micro_batch_size: int = 1
    global_batch_size: int = 1
    precision: str = "fp32"
    use_distributed_optimizer: bool = True
    grad_reduce_in_fp32: bool = True
    clip_grad: float = 1.0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    steps: int = 4
    seed: int = 1234
    sampler_seed: int = 0
    attention_backend: str = "auto"
    mtp: bool = False
    mtp_loss_scaling_factor: float = 0.1
    mtp_detach_heads: bool = False
    mtp_only: bool = False
    random_weights: bool = False
    model_overrides: dict[str, Any] = field(default_factory=dict)
    lora: LoRAConfig | None = None
    cuda_graph: bool = False
    optimizer_offload_fraction: float = 0.0
    shuffle: bool = True  # False: the data set's order, so every global batch holds the same rows


def learning_rate(config: LoopConfig, step: int) -> float:
    """Linear warm-up, then cosine to `min_lr_ratio * lr` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.steps <= config.warmup_steps:
        return config.lr
    progress = min(1.0, (step - config.warmup_steps) / (config.steps - config.warmup_steps))
    ratio = config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * ratio


def run(config: LoopConfig, dataset: Dataset, *, collate_fn: Callable[[list], dict] | None = None,
        step_context: Callable[[int], contextlib.AbstractContextManager] | None = None) -> dict[str, Any]:
    """Train `config.steps` steps; every rank returns the per-step loss and times (torch.distributed must be up).

    `step_context(step)`: a context each step runs in (a profiler around one of them)."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    from bench.common import release_model
    from lightning_megatron._compat import prepare_megatron_core
    from lightning_megatron.cuda_graphs.full_iteration import FullIterationGraph
    from lightning_megatron.cuda_graphs.options import SEQUENCES_PER_ROW

    prepare_megatron_core()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
    )
    seed = config.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True,
                                                    use_cudagraphable_rng=config.cuda_graph)
    chunks = _build(config)
    graph = None
    try:
        if config.cuda_graph:  # made before DDP wraps the model, as the strategy does: the fit's stream changes with it
            graph = FullIterationGraph(chunks, SEQUENCES_PER_ROW)
        model, optimizer = _wrap(config, chunks)
        chunks = model
        return {**_train(config, dataset, model, optimizer, graph, collate_fn, step_context), "model": model}
    except BaseException:
        release_model(chunks)
        raise
    finally:
        if graph is not None:
            graph.release()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _build(config: LoopConfig) -> list[torch.nn.Module]:
    """The model chunks from the HF checkpoint through the bridge, frozen for MTP-only or given LoRA adapters."""
    from megatron.core import parallel_state

    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.lora import add_lora_adapters
    from lightning_megatron.mtp.parameters import freeze_non_mtp_parameters
    from lightning_megatron.options import ModelOptions

    bf16 = config.precision == "bf16"
    overrides = {"calculate_per_token_loss": True} | ({} if bf16 else {"cross_entropy_loss_fusion": False})
    options = ModelOptions(params_dtype=torch.bfloat16 if bf16 else torch.float32, mtp=config.mtp,
                           mtp_loss_scaling_factor=config.mtp_loss_scaling_factor if config.mtp else 0.0,
                           mtp_detach_heads=config.mtp_detach_heads, attention_backend=config.attention_backend,
                           config_overrides=overrides | config.model_overrides, random_weights=config.random_weights)
    chunks = [chunk.to(_device()) for chunk in create_bridge(config.bridge_type, config.hf_checkpoint).build(options)]
    if config.mtp_only:  # every non-MTP parameter frozen before DDP and the optimizer exist, nothing else
        freeze_non_mtp_parameters(chunks, allow_missing_mtp=not parallel_state.is_pipeline_last_stage(
            ignore_virtual=True))
    if config.lora is not None:  # what LoRACallback's pre-wrap hook does
        add_lora_adapters(chunks, config.lora)
    return chunks


def _wrap(config: LoopConfig, chunks: list[torch.nn.Module]) -> tuple[list[torch.nn.Module], Any]:
    """Float16Module (bf16), Megatron DDP and Megatron's optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    bf16 = config.precision == "bf16"
    model_config = get_model_config(chunks[0])
    if bf16:
        model_config.bf16 = True
        chunks = [Float16Module(model_config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=config.grad_reduce_in_fp32,
                                               use_distributed_optimizer=config.use_distributed_optimizer)
    model = [DistributedDataParallel(model_config, ddp_config, chunk, disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    model_config.no_sync_func = model[0].no_sync if len(model) == 1 else [chunk.no_sync for chunk in model]
    model_config.finalize_model_grads_func = finalize_model_grads
    offload = ({} if not config.optimizer_offload_fraction else dict(
        optimizer_cpu_offload=True, optimizer_offload_fraction=config.optimizer_offload_fraction,
        use_precision_aware_optimizer=True))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=config.lr, min_lr=config.lr * config.min_lr_ratio,
                        weight_decay=config.weight_decay, adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2,
                        adam_eps=config.adam_eps, clip_grad=config.clip_grad, bf16=bf16,
                        params_dtype=torch.bfloat16 if bf16 else torch.float32,
                        use_distributed_optimizer=config.use_distributed_optimizer, **offload),
        model,
    )
    model_config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def _train(config: LoopConfig, dataset: Dataset, model: list[torch.nn.Module], optimizer: Any, graph: Any,
           collate_fn: Callable[[list], dict] | None,
           step_context: Callable[[int], contextlib.AbstractContextManager] | None) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.utils import get_model_config

    from bench.common import CpuClock, live_threads
    from lightning_megatron._compat.fused_adam import implementations
    from lightning_megatron.microbatch import model_inputs

    device = _device()
    moe = bool(get_model_config(model[0]).num_moe_experts)
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = config.global_batch_size // (config.micro_batch_size * data_parallel_size)
    sampler = DistributedSampler(dataset, num_replicas=data_parallel_size,
                                 rank=parallel_state.get_data_parallel_rank(), shuffle=config.shuffle,
                                 seed=config.sampler_seed)
    loader = DataLoader(dataset, batch_size=config.micro_batch_size, sampler=sampler, drop_last=True,
                        collate_fn=collate_fn)

    def global_batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            microbatches = [  # packed rows keep `max_seqlen` a host int
                {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
                for batch in loader
            ]
            for start in range(0, len(microbatches) - num_microbatches + 1, num_microbatches):
                yield microbatches[start:start + num_microbatches]
            epoch += 1

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return chunk(**model_inputs(batch)), partial(loss_func, batch["loss_mask"])

    def loss_func(loss_mask, per_token_loss):
        loss_sum = (per_token_loss.float() * loss_mask.float()).sum()
        num_tokens = loss_mask.sum().to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach().float()])}

    def forward_backward(microbatches):
        arguments = dict(forward_step_func=forward_step, model=model, num_microbatches=num_microbatches,
                         seq_length=microbatches[0]["input_ids"].shape[1], micro_batch_size=config.micro_batch_size,
                         forward_only=False)
        if graph is not None:  # what MegatronStrategy(cuda_graph="full_iteration") runs
            return graph.run(get_forward_backward_func(), graph.static_microbatches(microbatches), **arguments)
        return get_forward_backward_func()(
            data_iterator=[iter(microbatches) for _ in model] if len(model) > 1 else iter(microbatches), **arguments)

    losses, mtp_losses, step_times, grad_norms = [], [], [], []
    process_cpu, main_thread_cpu = [], []
    batches = global_batches()
    setup_peak_memory = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        setup_peak_memory = torch.cuda.max_memory_allocated()  # building and wrapping; training's peak is apart
        torch.cuda.reset_peak_memory_stats()
    previous_end = time.perf_counter()
    cpu = CpuClock()
    for step in range(config.steps):
        microbatches = next(batches)
        with step_context(step) if step_context is not None else contextlib.nullcontext():
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step)
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(microbatches)
            _, grad_norm, _ = optimizer.step()
            totals = torch.zeros(2, dtype=torch.float64, device=device)
            for values in reduced:
                totals += values["lm loss"].to(device, torch.float64)
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
            losses.append(float((totals[0] / totals[1]).float()))
            grad_norms.append(None if grad_norm is None else float(grad_norm))
            if config.mtp:
                mtp_losses.append(_read_and_clean_mtp_tracker(num_microbatches))
            if moe:  # the router's load-balancing metrics, summed until read: cleared as bench/moe.py does
                get_moe_metrics_tracker().clear()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        end = time.perf_counter()
        step_times.append(end - previous_end)
        previous_end = end
        for series, seconds in zip((process_cpu, main_thread_cpu), cpu.lap()):
            series.append(seconds)
    return {"losses": losses, "mtp_losses": mtp_losses, "grad_norms": grad_norms, "step_times_s": step_times,
            "process_cpu_s": process_cpu, "main_thread_cpu_s": main_thread_cpu, "threads": live_threads(),
            "setup_peak_memory_bytes": setup_peak_memory, "adam": implementations(optimizer)}


def _read_and_clean_mtp_tracker(num_microbatches: int) -> float:
    """This step's MTP loss (mean over microbatches, unscaled), the way Megatron-LM's training_log reads it."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.reduce_metrics_in_tracker()
    tracker = MTPLossLoggingHelper.tracker
    loss = float(tracker["loss_values"].sum()) / num_microbatches if "loss_values" in tracker else float("nan")
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default=None, help="HF checkpoint (default: a tiny qwen3 made locally)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from bench.common import TINY_SCRATCH_BYTES, scratch_dir
    from lightning_megatron.distributed import init_single_process
    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
    from lightning_megatron.testing.datasets import RandomTokenDataset

    init_single_process()
    with scratch_dir("megatron_loop_", TINY_SCRATCH_BYTES) as folder:
        checkpoint = args.checkpoint or str(make_tiny_checkpoint(folder / "qwen3", "qwen3"))
        result = run(LoopConfig(hf_checkpoint=checkpoint, micro_batch_size=2, global_batch_size=4, steps=args.steps),
                     RandomTokenDataset(64, 32, 384))
    print(json.dumps({key: value for key, value in result.items() if key != "model"}, indent=2))


if __name__ == "__main__":
    main()
