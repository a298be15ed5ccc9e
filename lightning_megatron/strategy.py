"""`MegatronStrategy`: Megatron-Core's parallelism, optimizer and schedules behind Lightning's `Trainer`.

Lifecycle (the order Lightning calls us in):
- `setup_environment`: process group, Megatron parallel state, RNG, then the model built from the HF checkpoint
  through a bridge and attached to the LightningModule, so that callbacks' `setup` already sees real parameters.
  Callbacks with a `validate_megatron_setup(strategy, module)` method (`ValidatesMegatronSetup`) are asked first,
  so that a combination they cannot serve fails before any weights are loaded. A module's later runs (`validate`,
  `test`, `predict` after `fit`, another `fit`, a new Trainer) keep its model and trained weights, as Lightning
  runs a module's current weights; one that would build another model is refused, naming what differs.
- `setup`: pre-wrap hooks in registration order, Float16Module (bf16), Megatron DDP (which only registers parameters
  that require grad at this moment), then `configure_optimizers` (which builds the Megatron optimizer through
  `megatron_optimizer`).
- training: each Lightning batch is one global batch (a list of microbatches); the module's `training_step` hands it
  to `forward_backward`, which runs Megatron's schedule (no pipelining, 1F1B or interleaved; see `schedule.py`);
  Lightning's automatic optimization then calls the Megatron optimizer (clipping, grad norm) and the LR scheduler.
- checkpoints: every rank writes its shard with Megatron's distributed checkpointing (see `checkpoint.py`); with
  `async_save` the shards are written in the background while training goes on (see `background_save.py`).
- `teardown`: what only training hung on the model goes (`schedule.release_training_hooks`): the model, its buffers
  and optimizer are freed once the module and Trainer are dropped; the next run's `setup` drops the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, override

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_megatron import checkpoint as megatron_checkpoint
from lightning_megatron import schedule
from lightning_megatron.background_save import BackgroundSaves
from lightning_megatron.bridges import Bridge, backend_class
from lightning_megatron.contract import (
    MegatronLightningModule,
    MegatronStrategyContract,
    ModelBuild,
    PreWrapHook,
    ValidatesMegatronSetup,
)
from lightning_megatron.cuda_graphs.full_iteration import StrategyCudaGraphs
from lightning_megatron.cuda_graphs.options import SEQUENCES_PER_ROW, CudaGraph
from lightning_megatron.data.settings import DataSettings, hand_data_settings
from lightning_megatron.distributed import ParallelSizes, all_reduced
from lightning_megatron.microbatch import LossOutput, Microbatch
from lightning_megatron.moe import check_expert_parallel_world
from lightning_megatron.optimizer import (
    MegatronOptimizerAdapter,
    check_megatron_optimizers,
    check_optimizer_offload,
    check_optimizer_offload_device,
    megatron_optimizer,
)
from lightning_megatron.options import AttentionBackend, BridgeType, check_strategy_options, check_trainer_options


class MegatronStrategy(ParallelStrategy, MegatronStrategyContract):
    """Train, evaluate and export an HF checkpoint with Megatron-Core's TP/PP/VPP/CP/EP/SP/DP under Lightning.

    Batch sizes are Megatron's: one optimizer step consumes `global_batch_size` samples over all DP ranks, in
    microbatches of `micro_batch_size` (replacing `accumulate_grad_batches`; `clip_grad` replaces `gradient_clip_val`).
    Options are checked before the model is built, an error naming the option and the fix.

    Args:
        hf_checkpoint: the HF checkpoint folder the model is built from.
        bridge_type: mbridge (default; no MTP heads, no LoRA) or megatron-bridge: what converts HF <-> Megatron.
        tensor_model_parallel_size: TP, the ranks each layer's weights are split over.
        pipeline_model_parallel_size: PP, the ranks the layers are divided between.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved schedule); null: none.
        context_parallel_size: CP, the ranks each sequence is split over.
        expert_model_parallel_size: EP, the ranks MoE experts are divided between.
        expert_tensor_parallel_size: ETP, the ranks each expert's FFN is split over; null: the TP size.
        sequence_parallel: split the norms' and dropouts' activations over the TP ranks (needs TP > 1).
        micro_batch_size: samples per microbatch on each data-parallel rank.
        global_batch_size: samples per optimizer step over all DP ranks; null: one microbatch per DP rank.
        precision: bf16 (fp32 main weights in the optimizer) or fp32; replaces the Trainer's precision.
        attention_backend: auto (SDPA without Transformer Engine), sdpa, or local (Megatron-Core's own).
        use_distributed_optimizer: shard the optimizer state over the DP ranks (Megatron's distributed optimizer).
        overlap_grad_reduce: overlap the gradients' reduction with the backward.
        grad_reduce_in_fp32: reduce (and accumulate) gradients in fp32.
        clip_grad: the gradient norm Megatron's optimizer clips to; 0: no clipping.
        optimizer_offload_fraction: 0 (default) to 1: that fraction of the fp32 master weights and Adam states in
            host memory, stepped on the CPU (Megatron-Core's HybridDeviceOptimizer, `optimizer.py`; what fits full
            fine-tuning of 8B on one 141 GB GPU). Needs a CUDA device, bf16 and the distributed optimizer.
        seed: seeds Python, NumPy, torch and Megatron's model-parallel RNG streams (one seed per pipeline stage).
        trust_remote_code: let transformers run code from the checkpoint folder (see the README's Security).
        checkpoint_optimizer_sharding: fully_reshardable (default: resumes at any parallel sizes) or dp_reshardable
            (the distributed optimizer saved without gathering: faster, resumes only at the same model-parallel sizes).
        async_save: saves made while training write their shards in the background (`background_save.py`).
        cuda_graph: training steps replayed from one captured CUDA graph (`cuda_graphs/full_iteration.py`), so the
            host no longer paces the GPU. auto (default): graphed where nothing is in the way (one CUDA device and
            process, no PP, CP or EP, no MoE, tree rows, MTP-only training or dropout, the SDPA core, a module with
            replayable_training_step), else (and on a CPU) eager; said once in one INFO line; a failed capture falls
            back to eager with a warning. Validation is eager. full_iteration: the same graph, refusing (naming the
            fix) what it cannot serve; none: always eager, silently.
        cuda_graph_sequences_per_row: the sequences packed rows are padded to inside the graph (a positive integer).
        process_group_backend: nccl or gloo; null: nccl on a GPU, gloo on a CPU.
        timeout_minutes: the process group's timeout.
        accelerator: Lightning's, set by the Trainer.
        parallel_devices: Lightning's, set by the Trainer.
        cluster_environment: Lightning's, set by the Trainer.
        checkpoint_io: Lightning's; unused: every rank writes its shard through Megatron's distributed checkpointing.
    """

    strategy_name = "megatron"

    def __init__(
        self, hf_checkpoint: str | None = None, bridge_type: BridgeType = "mbridge",
        tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None, context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
        sequence_parallel: bool = False, micro_batch_size: int = 1, global_batch_size: int | None = None,
        precision: Literal["bf16", "fp32"] = "bf16", attention_backend: AttentionBackend = "auto",
        use_distributed_optimizer: bool = True, overlap_grad_reduce: bool = False, grad_reduce_in_fp32: bool = True,
        clip_grad: float = 1.0, optimizer_offload_fraction: float = 0.0, seed: int = 1234,
        trust_remote_code: bool = False,
        checkpoint_optimizer_sharding: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable",
        async_save: bool = False, cuda_graph: CudaGraph = "auto",
        cuda_graph_sequences_per_row: int = SEQUENCES_PER_ROW,
        process_group_backend: Literal["nccl", "gloo"] | None = None, timeout_minutes: int = 30,
        accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io)
        check_strategy_options(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size, expert_model_parallel_size=expert_model_parallel_size,
            sequence_parallel=sequence_parallel, micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size, precision=precision, attention_backend=attention_backend,
            clip_grad=clip_grad, timeout_minutes=timeout_minutes)
        megatron_checkpoint.check_optimizer_sharding(checkpoint_optimizer_sharding, use_distributed_optimizer)
        check_optimizer_offload(optimizer_offload_fraction, use_distributed_optimizer=use_distributed_optimizer,
                                precision=precision)
        self.cuda_graphs = StrategyCudaGraphs(cuda_graph, cuda_graph_sequences_per_row, ParallelSizes(
            pipeline=pipeline_model_parallel_size, context=context_parallel_size, expert=expert_model_parallel_size))
        backend_class(bridge_type)  # an unknown bridge_type fails here, naming the registered ones
        self.hf_checkpoint = hf_checkpoint
        self.bridge_type = bridge_type
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.virtual_pipeline_model_parallel_size = virtual_pipeline_model_parallel_size
        self.context_parallel_size = context_parallel_size
        self.expert_model_parallel_size = expert_model_parallel_size
        self.expert_tensor_parallel_size = expert_tensor_parallel_size
        self.sequence_parallel = sequence_parallel
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.precision = precision
        self.attention_backend = attention_backend
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_grad_reduce = overlap_grad_reduce
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.clip_grad = clip_grad
        self.optimizer_offload_fraction = optimizer_offload_fraction
        self.seed = seed
        self.trust_remote_code = trust_remote_code
        self.checkpoint_optimizer_sharding = checkpoint_optimizer_sharding
        self._saves = BackgroundSaves(enabled=async_save)
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(minutes=timeout_minutes)
        self.num_nodes = 1  # the Trainer's num_nodes
        self._pre_wrap_hooks: list[PreWrapHook] = []
        self._bridge: Bridge | None = None
        self.model_chunks: list[torch.nn.Module] = []
        self._train_batches: schedule.GlobalBatches | None = None

    # ------------------------------------------------------------------ ranks, devices, launcher, bridge

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always: one process or many, data reaches the model through the same DP-aware sampler."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        from megatron.core import parallel_state

        return {"num_replicas": parallel_state.get_data_parallel_world_size(),
                "rank": parallel_state.get_data_parallel_rank()}

    @property
    def num_microbatches(self) -> int:
        """Microbatches per global batch on each data-parallel rank."""
        from megatron.core import parallel_state

        return schedule.microbatches_per_global_batch(self.global_batch_size, self.micro_batch_size,
                                             parallel_state.get_data_parallel_world_size())

    @property
    def bridge(self) -> Bridge:
        """The bridge backend that builds and exports the model; it exists from `setup_environment` on."""
        if self._bridge is None:
            raise RuntimeError(f"MegatronStrategy.bridge: no bridge yet (bridge_type: {self.bridge_type}); it is "
                               "created when the Trainer runs (trainer.fit/validate/test/predict): ask for it from a "
                               "hook or after the Trainer ran")
        return self._bridge

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.num_nodes * self.num_processes > 1 and not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = None  # one process (a notebook too), or torchrun/SLURM made the processes

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup_environment: parallel state + model

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        from lightning_megatron._compat import prepare_megatron_core

        module = self.lightning_module
        if not isinstance(module, MegatronLightningModule):
            raise TypeError(f"MegatronStrategy trains a MegatronLightningModule (e.g. lightning_megatron.SFTModule); "
                            f"got {type(module).__name__}")
        check_trainer_options(module.trainer)
        if self.hf_checkpoint is None:
            raise ValueError("hf_checkpoint: MegatronStrategy needs the HF checkpoint folder to build the model from")
        self.cuda_graphs.check_run(self.root_device, self.world_size, module)
        check_optimizer_offload_device(self.optimizer_offload_fraction, self.root_device)
        prepare_megatron_core()
        self._init_parallel_state()
        self._build_model(module)

    def _init_parallel_state(self) -> None:
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        sizes = ParallelSizes.for_world(
            self.world_size, tensor=self.tensor_model_parallel_size, pipeline=self.pipeline_model_parallel_size,
            virtual_pipeline=self.virtual_pipeline_model_parallel_size, context=self.context_parallel_size,
            expert=self.expert_model_parallel_size,
            expert_tensor=self.expert_tensor_parallel_size or self.tensor_model_parallel_size,
        )
        check_expert_parallel_world(self.world_size, sizes.expert, sizes.expert_tensor, sizes.pipeline)
        sizes.initialize(timeout_minutes=int(self._timeout.total_seconds() // 60))
        schedule.seed_everything_megatron(self.seed, cudagraphable_rng=self.cuda_graphs.may_graph)
        _ = self.num_microbatches  # fail now, not at the first step, on a batch-size mismatch

    def _build_model(self, module: MegatronLightningModule) -> None:
        """The model from the HF checkpoint, or the one an earlier run built for this module (`ModelBuild`)."""
        options = module.model_options().under_strategy(
            precision=self.precision, sequence_parallel=self.sequence_parallel,
            attention_backend=self.attention_backend)
        build = ModelBuild.for_run(module, str(self.hf_checkpoint), self.bridge_type, self.trust_remote_code, options,
                                   self.root_device)
        self._bridge = build.bridge
        for callback in module.trainer.callbacks:
            if isinstance(callback, ValidatesMegatronSetup):
                callback.validate_megatron_setup(self, module)
        hand_data_settings(module.trainer.datamodule, self.data_settings(module))  # before the data's setup
        if build is module.megatron_build:  # kept: unwrapped, this run wraps the chunks as its own
            module.model = torch.nn.ModuleList(schedule.kept_chunks(list(module.model)))
        else:  # the bridge validates the options first
            module.model = torch.nn.ModuleList(chunk.to(self.root_device) for chunk in build.bridge.build(options))
            module.megatron_build = build

    def data_settings(self, module: MegatronLightningModule) -> DataSettings:
        """What the run decides for the data (`data.settings`), from the parallel state on: handed to the trainer's
        data module before its setup, and to any other data module the run reads (a weight sync's draft probe)."""
        return DataSettings(self.hf_checkpoint, self.micro_batch_size, ParallelSizes.current(),
                            mtp_head=module.model_options().mtp)

    # ------------------------------------------------------------------ setup: pre-wrap hooks, DDP, optimizer

    def register_pre_wrap_hook(self, hook: PreWrapHook) -> None:
        """Run `hook(chunks)` in `setup` before Megatron DDP wraps the model (freezing, adapters); in order."""
        self._pre_wrap_hooks.append(hook)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_chunks, self.optimizers, self.lr_scheduler_configs = [], [], []  # the last run's go first
        module = self.lightning_module
        chunks = list(module.model)
        for hook in self._pre_wrap_hooks:
            hook(chunks)
        if trainer.state.fn == TrainerFn.FITTING:
            self.cuda_graphs.make(chunks)  # before DDP wraps them: the fit's stream changes with the graph
        self.model_chunks = schedule.wrap_chunks(
            chunks, bf16=self.precision == "bf16", train=trainer.state.fn == TrainerFn.FITTING,
            grad_reduce_in_fp32=self.grad_reduce_in_fp32, overlap_grad_reduce=self.overlap_grad_reduce,
            use_distributed_optimizer=self.use_distributed_optimizer)
        module.model = torch.nn.ModuleList(self.model_chunks)
        self.model = module
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            check_megatron_optimizers(self.optimizers)
        self.setup_precision_plugin()

    def megatron_optimizer(self, config: Any) -> MegatronOptimizerAdapter:
        """Megatron's optimizer for the wrapped chunks; precision, distribution and clipping come from the strategy.

        Call it from `configure_optimizers` with an `megatron.core.optimizer.OptimizerConfig` carrying the
        optimizer's own hyperparameters (lr, betas, weight decay).
        """
        return megatron_optimizer(config, self.model_chunks, bf16=self.precision == "bf16",
                                  use_distributed_optimizer=self.use_distributed_optimizer, clip_grad=self.clip_grad,
                                  offload_fraction=self.optimizer_offload_fraction)

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """One Lightning batch = the microbatches of one global batch (a partial last group only without drop_last)."""
        return schedule.GlobalBatches(dataloader, self.num_microbatches, training=self.lightning_module.trainer.training,
                                      host=schedule.HostWork.current(self.sequence_parallel, self.root_device))

    @override
    def on_train_start(self) -> None:
        loader = self.lightning_module.trainer.train_dataloader
        self._train_batches = loader if isinstance(loader, schedule.GlobalBatches) else None
        self._saves.begin_training(self.model_chunks)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._saves.poll()  # a background save that finished is published; one that failed raises here

    @override
    def on_train_end(self) -> None:
        self._saves.end_training()  # the last save is published before fit returns

    # ------------------------------------------------------------------ steps

    def forward_backward(self, microbatches: list[Microbatch],
                         forward_step: Callable[[torch.nn.Module, Microbatch], torch.Tensor],
                         loss_func: Callable[[Microbatch, torch.Tensor], LossOutput], *,
                         forward_only: bool = False) -> dict[str, torch.Tensor]:
        """Megatron's schedule over one global batch; returns each metric of `loss_func` token-weighted.

        Metrics are summed over microbatches and data-parallel x context-parallel ranks, then divided by their
        token counts, and are the same on every rank (pipeline stages without the loss receive it).
        """
        if not forward_only:
            for chunk in self.model_chunks:
                chunk.zero_grad_buffer()
            for optimizer in self.optimizers:
                optimizer.zero_grad()
        module = self.lightning_module
        assert isinstance(module, MegatronLightningModule)  # checked in setup_environment
        metrics = schedule.run_schedule(
            self.model_chunks, microbatches, forward_step, loss_func, forward_only=forward_only,
            cut_for_context_parallel=not module.cuts_context_parallel_in_model, device=self.root_device,
            graph=self.cuda_graphs.graph)
        if not forward_only and self._train_batches is not None:
            self._train_batches.consumed += 1
        return metrics

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Nothing left to do: `forward_backward` ran the backward passes inside Megatron's schedule."""
        if closure_loss.requires_grad:
            raise RuntimeError("training_step must run the model through trainer.strategy.forward_backward(...) and "
                               "return one of its metrics; a loss that still needs backward is not supported")
        self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        if isinstance(optimizer, MegatronOptimizerAdapter) and isinstance(module, MegatronLightningModule):
            module.log_step_metrics(optimizer.step_metrics())
        return output

    # ------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """A reduced copy of `tensor` (`distributed.all_reduced`); anything else as it is."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        return all_reduced(tensor, group=group, reduce_op=reduce_op)

    @override
    def model_to_device(self) -> None:
        """The bridge built the chunks on the right device in `setup_environment`; this moves the rest of the
        module (metrics, buffers) there too."""
        self.lightning_module.to(self.root_device)

    # ------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer must exist before its sharded state can be loaded

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` loads it in place

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is saved sharded, by every rank, in `save_checkpoint`

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("MegatronStrategy.save_checkpoint takes no storage_options (it writes a sharded folder)")
        path = Path(self.broadcast(str(filepath)))
        with_optimizer = "optimizer_states" in checkpoint and bool(self.optimizers)
        self._saves.save(path, self.model_chunks, self.optimizers[0] if with_optimizer else None, checkpoint,
                         optimizer_sharding=self.checkpoint_optimizer_sharding)

    def finish_saves(self) -> None:
        """Block until a background save is published (all ranks call it); raises its failure."""
        self._saves.wait()

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None,
                        **kwargs: Any) -> dict[str, Any]:
        """Loads model (and, when fitting, optimizer) shards in place; returns Lightning's part of the checkpoint.

        Always weights-only, whatever `weights_only` says: see `lightning_megatron.safe_load`."""
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self.optimizers[0] if fitting and self.optimizers else None
        return megatron_checkpoint.load(Path(checkpoint_path), self.model_chunks, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Already loaded in place by `load_checkpoint`."""

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            self._saves.remove(Path(filepath))  # after the save in flight is published

    def export_hf(self, path: str | Path) -> Path:
        """Write an HF checkpoint of the current weights through the bridge (all ranks call it; rank 0 writes)."""
        from megatron.core.utils import unwrap_model

        return self.bridge.save_hf([unwrap_model(chunk) for chunk in self.model_chunks], path)

    @override
    def teardown(self) -> None:
        """The model stays on its device, not moved to the CPU: `export_hf` after fit gathers it with NCCL."""
        self._train_batches = None
        schedule.release_training_hooks(self.model_chunks)  # what only training needs kept it past the trainer
        self._saves.abort()  # only an exception leaves a save in flight here: on_train_end waited for it
        self.cuda_graphs.release()  # the graph's memory, and the stream the fit ran on
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

