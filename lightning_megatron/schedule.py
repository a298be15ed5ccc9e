"""One Lightning batch = one global batch through Megatron's schedule.

`GlobalBatches` groups a DataLoader's microbatches into the global batches `MegatronStrategy` hands its module
(checked, and on a CUDA run pinned, on the host before Lightning copies them to the device: `HostCheckedBatch`);
`wrap_chunks` puts Float16Module and Megatron DDP around the model chunks, with the hooks the schedule calls, and
`release_training_hooks` lets them go when the training ends, and `kept_chunks` hands a later run on the same module
(evaluation after `fit`, another `fit`) that model unwrapped;
`run_schedule` runs one global batch through Megatron-Core's forward-backward schedule (no pipelining, 1F1B or
interleaved) and returns its metrics token-weighted over microbatches, data- and context-parallel ranks and
pipeline stages; `seed_everything_megatron` seeds the RNGs the way Megatron-LM does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils.data import DistributedSampler

from lightning_megatron.microbatch import LossOutput, Microbatch, check_microbatch, split_for_context_parallel

if TYPE_CHECKING:
    from lightning_megatron.cuda_graphs.full_iteration import FullIterationGraph


def microbatches_per_global_batch(global_batch_size: int | None, micro_batch_size: int,
                                  data_parallel_size: int) -> int:
    """How many microbatches each data-parallel rank runs per global batch (None: one microbatch per rank)."""
    global_batch_size = global_batch_size or micro_batch_size * data_parallel_size
    if global_batch_size % (micro_batch_size * data_parallel_size):
        raise ValueError(
            f"global_batch_size: {global_batch_size} must be a multiple of micro_batch_size x data-parallel "
            f"size = {micro_batch_size} x {data_parallel_size}"
        )
    return global_batch_size // (micro_batch_size * data_parallel_size)


class HostCheckedBatch(list):
    """A global batch (its microbatches) whose layouts were checked on the host (`check_microbatch`) before Lightning
    copied it to the device; Lightning's copy keeps the list's type, so `run_schedule` knows not to check it again.

    Checking a packed row reads its `cu_seqlens` values: on the device, a synchronisation per packed microbatch (the
    host waits for the GPU work queued before it), on the host, none. A pytree node like a list (registered below),
    so `torch.utils._pytree` users (callbacks mapping over the batch) see its microbatches, not one leaf."""


pytree.register_pytree_node(
    HostCheckedBatch, lambda batch: (list(batch), None), lambda children, _: HostCheckedBatch(children),
    serialized_type_name="lightning_megatron.schedule.HostCheckedBatch",
    flatten_with_keys_fn=lambda batch: ([(pytree.SequenceKey(index), microbatch)
                                         for index, microbatch in enumerate(batch)], None))


class GlobalBatches:
    """Groups a DataLoader's microbatches into global batches; resumable mid-epoch (Lightning saves its state).

    The position saved is the number of global batches *trained* this epoch (the strategy counts them), not the
    number fetched, because Lightning fetches one batch ahead. `training`: data too small for one global batch is
    refused. `host`: the work done on each microbatch on the host before Lightning copies it to the device
    (`HostWork`); None: none (`run_schedule` then checks them).
    """

    def __init__(self, dataloader: Any, num_microbatches: int, *, training: bool = False,
                 host: HostWork | None = None) -> None:
        self.dataloader = dataloader
        self.num_microbatches = num_microbatches
        self.host = host
        self.drop_last = bool(getattr(dataloader, "drop_last", False))
        self.consumed = 0
        self._epoch = 0
        self._skip = 0
        if training:
            self._refuse_too_little_data()

    def _refuse_too_little_data(self) -> None:
        """Training data that cannot fill one global batch: Lightning would end `fit` without a step, as if it had
        succeeded."""
        try:
            microbatches = len(self.dataloader)
        except (TypeError, NotImplementedError):  # an iterable without a length: nothing to check beforehand
            return
        if microbatches >= (self.num_microbatches if self.drop_last else 1):
            return
        ranks = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        micro_batch_size = self.dataloader.batch_size
        raise ValueError(
            f"the training data gives each data-parallel rank ({ranks} in all) {microbatches} full "
            f"microbatches of micro_batch_size={micro_batch_size} rows, fewer than the {self.num_microbatches} that "
            f"one global batch (global_batch_size={self.num_microbatches * micro_batch_size * ranks}) needs, so fit "
            "would train nothing: add training rows, or lower global_batch_size or micro_batch_size"
        )

    @property
    def sampler(self) -> Any:
        return getattr(self.dataloader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.dataloader, "batch_sampler", None)

    def __len__(self) -> int:
        full, rest = divmod(len(self.dataloader), self.num_microbatches)
        return full if self.drop_last or not rest else full + 1

    def __iter__(self) -> Iterator[list[Microbatch]]:
        skip, self._skip = self._skip, 0
        self._epoch = getattr(self.sampler, "epoch", 0)
        self.consumed = skip
        group: list[Microbatch] = []
        index = 0
        for microbatch in self.dataloader:
            group.append(microbatch)
            if len(group) == self.num_microbatches:
                if index >= skip:
                    yield self._prepared(group)
                index += 1
                group = []
        if group and not self.drop_last and index >= skip:
            yield self._prepared(group)

    def _prepared(self, group: list[Microbatch]) -> list[Microbatch]:
        if self.host is None or not all(isinstance(microbatch, dict) for microbatch in group):
            return group
        if self.host.pin:
            group = [_pinned(microbatch) for microbatch in group]
        for microbatch in group:
            check_microbatch(microbatch, self.host.context_parallel_size, self.host.sequence_parallel_size)
        return HostCheckedBatch(group)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        finished_epoch = state_dict["consumed"] >= len(self)
        self._skip = 0 if finished_epoch else state_dict["consumed"]
        if not finished_epoch and callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(state_dict["epoch"])


@dataclass(frozen=True)
class HostWork:
    """What `GlobalBatches` does to each microbatch on the host: `check_microbatch` at these parallel sizes
    (`sequence_parallel_size`: the TP size under sequence parallelism, else 1), and with `pin` its tensors put in
    page-locked memory, so that Lightning's `non_blocking` copy to a CUDA device does not make the host wait."""

    context_parallel_size: int
    sequence_parallel_size: int
    pin: bool = False

    @classmethod
    def current(cls, sequence_parallel: bool, device: torch.device) -> HostWork:
        """For the parallel state set up, training on `device`."""
        from megatron.core import parallel_state

        tensor_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        return cls(parallel_state.get_context_parallel_world_size(),
                   tensor_parallel_size if sequence_parallel else 1, pin=device.type == "cuda")


def _pinned(microbatch: Microbatch) -> Microbatch:
    """The microbatch with its host tensors in page-locked memory (anything else as it is)."""
    return {key: value.pin_memory() if isinstance(value, torch.Tensor) and value.device.type == "cpu"
            and not value.is_pinned() else value for key, value in microbatch.items()}


def seed_everything_megatron(seed: int, cudagraphable_rng: bool = False) -> None:
    """Megatron-LM's seeding: a different seed per pipeline stage, Megatron's named model-parallel RNG streams
    (`cudagraphable_rng`: the graph-safe tracker, whose generators a CUDA graph capture registers)."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed, force_reset_rng=True,
                                                    use_cudagraphable_rng=cudagraphable_rng)


def wrap_chunks(chunks: list[torch.nn.Module], *, bf16: bool, train: bool, grad_reduce_in_fp32: bool,
                overlap_grad_reduce: bool, use_distributed_optimizer: bool) -> list[torch.nn.Module]:
    """Float16Module (bf16) and, for training, Megatron DDP around each chunk, with the hooks the schedule calls
    (`no_sync_func`, `finalize_model_grads_func`) set on the model config.

    Megatron DDP registers only the parameters that require grad when it wraps: freeze before calling this.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    if bf16:
        config.bf16 = True
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    if not train:
        return chunks
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def release_training_hooks(chunks: list[torch.nn.Module]) -> None:
    """Undo what training hung on the chunks, so that a finished model is freed once nobody holds it.

    Megatron DDP registers a hook on each trainable parameter's gradient accumulator, a closure over the DDP module,
    and keeps the accumulators (megatron/core/distributed/distributed_data_parallel.py:385-389, `grad_accs`); the
    distributed optimizer's fp32 shards are views of the parameters (megatron/core/optimizer/distrib_optimizer.py:467),
    whose graphs reach those accumulators too; the config reaches the optimizer (`grad_scale_func`, `optimizer.py`)
    and DDP (`no_sync_func`, `wrap_chunks`); an MoE token dispatcher keeps its last routing probabilities
    (megatron/core/transformer/moe/token_dispatcher.py:636), whose graph reaches DDP's hook on the router weight.
    These cycles run through autograd nodes, which the garbage collector cannot see: without this, every fit kept
    its model, gradient buffers and optimizer state for the life of the process. The chunks still run forward and
    export; a later run on the same module unwraps them (`kept_chunks`) and wraps them anew."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.utils import get_model_config

    for chunk in chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.grad_accs.clear()
        _drop_kept_graphs(chunk)
        config = get_model_config(chunk)
        for hook in ("grad_scale_func", "no_sync_func", "finalize_model_grads_func", "param_sync_func"):
            if getattr(config, hook, None) is not None:
                setattr(config, hook, None)


def kept_chunks(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """A finished run's chunks as the next run on the same module starts from them: without Float16Module and
    Megatron DDP, which that run wraps anew, and without the gradient views of the last fit's DDP buffers
    (`main_grad`), so that those buffers are freed with its DDP rather than kept through an evaluation."""
    from megatron.core.utils import unwrap_model

    bare = [unwrap_model(chunk) for chunk in chunks]
    for parameter in (parameter for chunk in bare for parameter in chunk.parameters()):
        for view in ("main_grad", "main_grad_copy_in_grad_buffer"):
            vars(parameter).pop(view, None)
    return bare


def _drop_kept_graphs(chunk: torch.nn.Module) -> None:
    """Forget the tensors with an autograd graph that a module, or an object of its own (an MoE layer's token
    dispatcher), kept from the last forward: leftovers of a step, whose graph reaches the parameters' hooks."""
    for module in chunk.modules():
        owners = (module, *(value for value in vars(module).values()
                            if not isinstance(value, (torch.nn.Module, type)) and hasattr(value, "__dict__")))
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(owner, name, None)


def run_schedule(
    model_chunks: list[torch.nn.Module],
    microbatches: list[Microbatch],
    forward_step: Callable[[torch.nn.Module, Microbatch], torch.Tensor],
    loss_func: Callable[[Microbatch, torch.Tensor], LossOutput],
    *,
    forward_only: bool,
    cut_for_context_parallel: bool,
    device: torch.device,
    graph: FullIterationGraph | None = None,
) -> dict[str, torch.Tensor]:
    """Megatron's schedule over one global batch; returns each metric of `loss_func` token-weighted.

    `cut_for_context_parallel`: hand `forward_step` this rank's part of each microbatch (False when the model cuts
    the sequence itself). Metrics are summed over microbatches and data-parallel x context-parallel ranks, then
    divided by their token counts, and are the same on every rank (pipeline stages without the loss receive it).
    `graph`: a training batch (not `forward_only`) runs through this whole-iteration CUDA graph (`cuda_graphs/`).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    sp_size = parallel_state.get_tensor_model_parallel_world_size() if get_model_config(
        model_chunks[0]).sequence_parallel else 1
    if not isinstance(microbatches, HostCheckedBatch):  # bad layouts fail here, before any forward pass of the step
        for microbatch in microbatches:
            check_microbatch(microbatch, cp_size, sp_size)
    graph = None if forward_only else graph
    if graph is not None:
        microbatches = graph.static_microbatches(microbatches)

    def megatron_forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module) -> tuple:
        microbatch = next(data_iterator)
        if cut_for_context_parallel:
            microbatch = split_for_context_parallel(microbatch, cp_rank, cp_size)
        return forward_step(model, microbatch), partial(loss_func, microbatch)

    iterators: Any = [iter(microbatches) for _ in model_chunks]
    seq_length, micro_batch_size = microbatches[0]["input_ids"].shape[1], microbatches[0]["input_ids"].shape[0]
    schedule_arguments = dict(forward_step_func=megatron_forward_step, model=model_chunks,
                              num_microbatches=len(microbatches), seq_length=seq_length,
                              micro_batch_size=micro_batch_size, forward_only=forward_only)
    if graph is not None:
        losses = graph.run(get_forward_backward_func(), microbatches, **schedule_arguments)
    else:
        losses = get_forward_backward_func()(data_iterator=iterators if len(iterators) > 1 else iterators[0],
                                             **schedule_arguments)
    return _reduce_metrics(losses, device, parallel_state)


def _reduce_metrics(losses: list[dict[str, torch.Tensor]], device: torch.device, parallel_state: Any) -> dict:
    """Sum `[sum, count]` pairs over microbatches and DP x CP ranks; broadcast from the last pipeline stage.

    Each metric's pairs are stacked and summed (in float64) in one go: a few tensor operations a step instead of a
    few per microbatch, each one host work on a host-bound step (issue 41)."""
    names = sorted(losses[0]) if losses else []
    names = _metric_names_from_last_stage(names, parallel_state)
    if losses and names:
        totals = torch.stack([
            torch.stack([microbatch_losses[name].view(2) for microbatch_losses in losses]).to(device, torch.float64)
            .sum(dim=0) for name in names])
    else:  # a stage without the loss: zeros, to receive the last stage's
        totals = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return {name: (totals[row, 0] / totals[row, 1].clamp(min=1)).float() for row, name in enumerate(names)}


def _metric_names_from_last_stage(names: list[str], parallel_state: Any) -> list[str]:
    """The metric names known on the last pipeline stage, on every stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return names
    container = [names]
    dist.broadcast_object_list(container, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return container[0]
