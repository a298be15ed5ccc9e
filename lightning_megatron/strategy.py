"""`MegatronStrategy`: Megatron-Core's parallelism, optimizer and schedules behind Lightning's `Trainer`.

Lifecycle (the order Lightning calls us in):
- `setup_environment`: process group, Megatron parallel state, RNG, then the model built from the HF checkpoint
  through a bridge and attached to the LightningModule, so that callbacks' `setup` already sees real parameters.
  Callbacks with a `validate_megatron_setup(strategy, module)` method are asked first, so that a combination they
  cannot serve fails before any weights are loaded.
- `setup`: pre-wrap hooks in registration order, Float16Module (bf16), Megatron DDP (which only registers parameters
  that require grad at this moment), then `configure_optimizers` (which builds the Megatron optimizer through
  `megatron_optimizer`).
- training: each Lightning batch is one global batch (a list of microbatches); the module's `training_step` hands it
  to `forward_backward`, which runs Megatron's schedule (no pipelining, 1F1B or interleaved); Lightning's automatic
  optimization then calls the Megatron optimizer (clipping, grad norm) and the LR scheduler.
- checkpoints: every rank writes its shard with Megatron's distributed checkpointing (see `checkpoint.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

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
from lightning_megatron.bridges import create_bridge
from lightning_megatron.distributed import parallel_sizes
from lightning_megatron.microbatch import LossOutput, Microbatch, check_microbatch, split_for_context_parallel
from lightning_megatron.module import MegatronLightningModule
from lightning_megatron.moe import check_expert_parallel_world
from lightning_megatron.optimizer import MegatronOptimizerAdapter
from lightning_megatron.options import AttentionBackend, BridgeType

PreWrapHook = Callable[[list[torch.nn.Module]], None]


class MegatronStrategy(ParallelStrategy):
    """Train, evaluate and export an HF checkpoint with Megatron-Core's TP/PP/VPP/CP/EP/SP/DP under Lightning.

    Batch sizes are Megatron's: each DP rank's dataloader yields `micro_batch_size` samples per batch and one
    optimizer step consumes `global_batch_size` samples over all DP ranks (Lightning's `accumulate_grad_batches`
    is replaced by `global_batch_size`, `gradient_clip_val` by `clip_grad`).
    Checkpoints load under any parallel sizes; `checkpoint_optimizer_sharding: dp_reshardable` saves the
    distributed optimizer without gathering it, and such a checkpoint resumes only with the same model-parallel sizes.
    """

    strategy_name = "megatron"

    def __init__(
        self,
        hf_checkpoint: str | None = None,
        bridge_type: BridgeType = "mbridge",
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        sequence_parallel: bool = False,
        micro_batch_size: int = 1,
        global_batch_size: int | None = None,
        precision: Literal["bf16", "fp32"] = "bf16",
        attention_backend: AttentionBackend = "auto",
        use_distributed_optimizer: bool = True,
        overlap_grad_reduce: bool = False,
        grad_reduce_in_fp32: bool = True,
        clip_grad: float = 1.0,
        seed: int = 1234,
        trust_remote_code: bool = False,
        checkpoint_optimizer_sharding: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable",
        process_group_backend: Literal["nccl", "gloo"] | None = None,
        timeout_minutes: int = 30,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io)
        _check_positive(tensor_model_parallel_size=tensor_model_parallel_size,
                        pipeline_model_parallel_size=pipeline_model_parallel_size,
                        context_parallel_size=context_parallel_size,
                        expert_model_parallel_size=expert_model_parallel_size, micro_batch_size=micro_batch_size,
                        timeout_minutes=timeout_minutes)
        if virtual_pipeline_model_parallel_size is not None:
            _check_positive(virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
            if pipeline_model_parallel_size == 1:
                raise ValueError("virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1; "
                                 "leave it unset (null) without pipeline parallelism")
        if context_parallel_size > 1 and attention_backend == "local":
            raise ValueError("context_parallel_size > 1 needs attention_backend: sdpa or auto (Megatron-Core's local "
                             "DotProductAttention has no context parallelism)")
        if sequence_parallel and tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel: true needs tensor_model_parallel_size > 1")
        if global_batch_size is not None:
            _check_positive(global_batch_size=global_batch_size)
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"precision: {precision!r} is not one of 'bf16', 'fp32'")
        if clip_grad < 0:
            raise ValueError(f"clip_grad: {clip_grad} must be >= 0 (0 disables clipping)")
        megatron_checkpoint.check_optimizer_sharding(checkpoint_optimizer_sharding, use_distributed_optimizer)
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
        self.seed = seed
        self.trust_remote_code = trust_remote_code
        self.checkpoint_optimizer_sharding = checkpoint_optimizer_sharding
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(minutes=timeout_minutes)
        self._num_nodes = 1
        self._pre_wrap_hooks: list[PreWrapHook] = []
        self._bridge: Any = None
        self.model_chunks: list[torch.nn.Module] = []
        self._train_batches: GlobalBatches | None = None

    # ------------------------------------------------------------------ ranks, devices, launcher

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always: one process or many, data reaches the model through the same DP-aware sampler."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        from megatron.core import parallel_state

        return {"num_replicas": parallel_state.get_data_parallel_world_size(),
                "rank": parallel_state.get_data_parallel_rank()}

    @property
    def num_microbatches(self) -> int:
        from megatron.core import parallel_state

        data_parallel_size = parallel_state.get_data_parallel_world_size()
        global_batch_size = self.global_batch_size or self.micro_batch_size * data_parallel_size
        if global_batch_size % (self.micro_batch_size * data_parallel_size):
            raise ValueError(
                f"global_batch_size: {global_batch_size} must be a multiple of micro_batch_size x data-parallel "
                f"size = {self.micro_batch_size} x {data_parallel_size}"
            )
        return global_batch_size // (self.micro_batch_size * data_parallel_size)

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

    def setup_environment(self) -> None:
        super().setup_environment()
        from lightning_megatron._compat import prepare_megatron_core

        module = self.lightning_module
        if not isinstance(module, MegatronLightningModule):
            raise TypeError(f"MegatronStrategy trains a MegatronLightningModule (e.g. lightning_megatron.SFTModule); "
                            f"got {type(module).__name__}")
        self._check_trainer_options(module.trainer)
        if self.hf_checkpoint is None:
            raise ValueError("hf_checkpoint: MegatronStrategy needs the HF checkpoint folder to build the model from")
        prepare_megatron_core()
        self._init_parallel_state()
        self._build_model(module)

    def _check_trainer_options(self, trainer: pl.Trainer) -> None:
        if trainer.gradient_clip_val:
            raise ValueError("Trainer(gradient_clip_val=...) is not used with MegatronStrategy: Megatron's optimizer "
                             "clips; set MegatronStrategy(clip_grad=...) instead")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError("Trainer(accumulate_grad_batches=...) is not used with MegatronStrategy: set "
                             "MegatronStrategy(global_batch_size=...) and Megatron accumulates the microbatches")
        if trainer.precision != "32-true":
            raise ValueError(f"Trainer(precision={trainer.precision!r}) is not used with MegatronStrategy: set "
                             "MegatronStrategy(precision='bf16' or 'fp32') and leave the Trainer's precision unset")

    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state

        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        if self.world_size % model_parallel:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of tensor x pipeline x context parallel sizes "
                f"(tensor_model_parallel_size {self.tensor_model_parallel_size} x pipeline_model_parallel_size "
                f"{self.pipeline_model_parallel_size} x context_parallel_size {self.context_parallel_size}); change "
                "devices/num_nodes or the parallel sizes"
            )
        check_expert_parallel_world(self.world_size, self.expert_model_parallel_size,
                                    self.expert_tensor_parallel_size or self.tensor_model_parallel_size,
                                    self.pipeline_model_parallel_size)
        sizes = {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size or self.tensor_model_parallel_size,
        }
        # Megatron never frees a process group it made: a second fit in the same process (a notebook, a test)
        # reuses the parallel state when the sizes are the same rather than leaking another set of groups.
        if not (parallel_state.model_parallel_is_initialized() and parallel_sizes() == sizes):
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(
                **sizes, distributed_timeout_minutes=int(self._timeout.total_seconds() // 60)
            )
        seed_everything_megatron(self.seed)
        _ = self.num_microbatches  # fail now, not at the first step, on a batch-size mismatch

    def _build_model(self, module: MegatronLightningModule) -> None:
        options = module.model_options()
        options = dataclasses.replace(
            options,
            params_dtype=torch.bfloat16 if self.precision == "bf16" else torch.float32,
            sequence_parallel=self.sequence_parallel,
            attention_backend=self.attention_backend,
            config_overrides={**self._config_overrides(), **options.config_overrides},
        )
        self._bridge = create_bridge(self.bridge_type, self.hf_checkpoint, trust_remote_code=self.trust_remote_code)
        for callback in module.trainer.callbacks:
            validate = getattr(callback, "validate_megatron_setup", None)
            if callable(validate):
                validate(self, module)
        self._bridge.validate(options)
        chunks = self._bridge.build(options)
        module.model = torch.nn.ModuleList(chunk.to(self.root_device) for chunk in chunks)

    def _config_overrides(self) -> dict[str, Any]:
        overrides: dict[str, Any] = {"calculate_per_token_loss": True}  # token-weighted over microbatches and DP x CP
        if self.precision == "fp32":
            # megatron-core's fused ("native") cross-entropy returns bf16 logit gradients whatever the dtype
            # (fusions/fused_cross_entropy.py:73); megatron-bridge turns it on by default
            overrides["cross_entropy_loss_fusion"] = False
        return overrides

    # ------------------------------------------------------------------ setup: pre-wrap hooks, DDP, optimizer

    def register_pre_wrap_hook(self, hook: PreWrapHook) -> None:
        """Run `hook(chunks)` in `setup` before Megatron DDP wraps the model (freezing, adapters); in order."""
        self._pre_wrap_hooks.append(hook)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        chunks = list(module.model)
        for hook in self._pre_wrap_hooks:
            hook(chunks)
        self.model_chunks = self._wrap(chunks, train=trainer.state.fn == TrainerFn.FITTING)
        module.model = torch.nn.ModuleList(self.model_chunks)
        self.model = module
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if not all(isinstance(optimizer, MegatronOptimizerAdapter) for optimizer in self.optimizers):
                raise TypeError("configure_optimizers must return the optimizer from "
                                "trainer.strategy.megatron_optimizer(OptimizerConfig(...)) (Megatron's optimizer "
                                "owns the DDP gradient buffers); do not configure it through LightningCLI's "
                                "optimizer: group")
        self.setup_precision_plugin()

    def _wrap(self, chunks: list[torch.nn.Module], *, train: bool) -> list[torch.nn.Module]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.transformer.module import Float16Module
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        if self.precision == "bf16":
            config.bf16 = True
            chunks = [Float16Module(config, chunk) for chunk in chunks]
        if not train:
            return chunks
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.grad_reduce_in_fp32,
            overlap_grad_reduce=self.overlap_grad_reduce,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        wrapped = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
        no_sync = [chunk.no_sync for chunk in wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.finalize_model_grads_func = finalize_model_grads
        return wrapped

    def megatron_optimizer(self, config: Any) -> MegatronOptimizerAdapter:
        """Megatron's optimizer for the wrapped chunks; precision, distribution and clipping come from the strategy.

        Call it from `configure_optimizers` with an `megatron.core.optimizer.OptimizerConfig` carrying the
        optimizer's own hyperparameters (lr, betas, weight decay).
        """
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.utils import get_model_config

        config = dataclasses.replace(
            config,
            bf16=self.precision == "bf16",
            params_dtype=torch.bfloat16 if self.precision == "bf16" else torch.float32,
            use_distributed_optimizer=self.use_distributed_optimizer,
            clip_grad=self.clip_grad,
        )
        optimizer = get_megatron_optimizer(config, self.model_chunks)
        get_model_config(self.model_chunks[0]).grad_scale_func = optimizer.scale_loss
        return MegatronOptimizerAdapter(optimizer)

    # ------------------------------------------------------------------ data

    def process_dataloader(self, dataloader: object) -> object:
        """One Lightning batch = the microbatches of one global batch (a partial last group only without drop_last)."""
        return GlobalBatches(dataloader, self.num_microbatches)

    def on_train_start(self) -> None:
        loader = self.lightning_module.trainer.train_dataloader
        self._train_batches = loader if isinstance(loader, GlobalBatches) else None

    # ------------------------------------------------------------------ steps

    def forward_backward(
        self,
        microbatches: list[Microbatch],
        forward_step: Callable[[torch.nn.Module, Microbatch], torch.Tensor],
        loss_func: Callable[[Microbatch, torch.Tensor], LossOutput],
        *,
        forward_only: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Megatron's schedule over one global batch; returns each metric of `loss_func` token-weighted.

        Metrics are summed over microbatches and data-parallel x context-parallel ranks, then divided by their
        token counts, and are the same on every rank (pipeline stages without the loss receive it).
        """
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not forward_only:
            for chunk in self.model_chunks:
                chunk.zero_grad_buffer()
            for optimizer in self.optimizers:
                optimizer.zero_grad()

        cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        for microbatch in microbatches:  # bad layouts fail here, before any forward pass of the step
            check_microbatch(microbatch, cp_size)

        # A model that fuses other inputs into the sequence first (Qwen3-VL's images) cuts it for CP itself.
        cut_here = not getattr(self.lightning_module, "cuts_context_parallel_in_model", False)

        def megatron_forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module) -> tuple:
            microbatch = next(data_iterator)
            if cut_here:
                microbatch = split_for_context_parallel(microbatch, cp_rank, cp_size)
            return forward_step(model, microbatch), partial(loss_func, microbatch)

        iterators: Any = [iter(microbatches) for _ in self.model_chunks]
        seq_length, micro_batch_size = microbatches[0]["input_ids"].shape[1], microbatches[0]["input_ids"].shape[0]
        losses = get_forward_backward_func()(
            forward_step_func=megatron_forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model_chunks,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        if not forward_only and self._train_batches is not None:
            self._train_batches.consumed += 1
        return _reduce_metrics(losses, self.root_device, parallel_state)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Nothing left to do: `forward_backward` ran the backward passes inside Megatron's schedule."""
        if closure_loss.requires_grad:
            raise RuntimeError("training_step must run the model through trainer.strategy.forward_backward(...) and "
                               "return one of its metrics; a loss that still needs backward is not supported")
        self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if isinstance(optimizer, MegatronOptimizerAdapter):
            module = self.lightning_module
            if optimizer.last_grad_norm is not None:
                module.log("grad_norm", optimizer.last_grad_norm, on_step=True, on_epoch=False)
            for group, norm in optimizer.last_grad_norms_by_group.items():
                module.log(f"grad_norm_{group}", norm, on_step=True, on_epoch=False)
            if optimizer.param_groups:
                module.log("lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)
        return output

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """A reduced copy of `tensor`: `reduce_op` "mean"/"avg" (None too; an integer tensor stays integer, as in
        Lightning's DDP), "sum", "max", "min", or a `torch.distributed.ReduceOp`."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        name = "mean" if reduce_op is None else reduce_op.lower() if isinstance(reduce_op, str) else None
        mean = name in ("mean", "avg")
        op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, name.upper()) if name else reduce_op
        result = tensor.clone()
        dist.all_reduce(result, op=op, group=group)
        if mean:
            result.copy_(result / dist.get_world_size(group))
        return result

    def model_to_device(self) -> None:
        """The bridge built the chunks on the right device in `setup_environment`; this moves the rest of the
        module (metrics, buffers) there too."""
        self.lightning_module.to(self.root_device)

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer must exist before its sharded state can be loaded

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` loads it in place

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is saved sharded, by every rank, in `save_checkpoint`

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("MegatronStrategy.save_checkpoint takes no storage_options (it writes a sharded folder)")
        path = Path(self.broadcast(str(filepath)))
        with_optimizer = "optimizer_states" in checkpoint and bool(self.optimizers)
        megatron_checkpoint.save(path, self.model_chunks, self.optimizers[0] if with_optimizer else None, checkpoint,
                                 optimizer_sharding=self.checkpoint_optimizer_sharding)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None,
                        **kwargs: Any) -> dict[str, Any]:
        """Loads model (and, when fitting, optimizer) shards in place; returns Lightning's part of the checkpoint.

        Always weights-only, whatever `weights_only` says: see `lightning_megatron.safe_load`."""
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self.optimizers[0] if fitting and self.optimizers else None
        return megatron_checkpoint.load(Path(checkpoint_path), self.model_chunks, optimizer)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Already loaded in place by `load_checkpoint`."""

    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            megatron_checkpoint.remove(Path(filepath))

    @property
    def bridge(self) -> Any:
        """The bridge backend that built the model (`lightning_megatron.bridges.Bridge`), after `setup_environment`."""
        return self._bridge

    def export_hf(self, path: str | Path) -> Path:
        """Write an HF checkpoint of the current weights through the bridge (all ranks call it; rank 0 writes)."""
        from megatron.core.utils import unwrap_model

        return self._bridge.save_hf([unwrap_model(chunk) for chunk in self.model_chunks], path)

    def teardown(self) -> None:
        """Lightning's default moves the model to the CPU; here it stays on its device, because `export_hf` after
        fit gathers the shards with the process group's collectives (NCCL needs them on the GPU)."""
        self._train_batches = None
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


class GlobalBatches:
    """Groups a DataLoader's microbatches into global batches; resumable mid-epoch (Lightning saves its state).

    The position saved is the number of global batches *trained* this epoch (the strategy counts them), not the
    number fetched, because Lightning fetches one batch ahead.
    """

    def __init__(self, dataloader: Any, num_microbatches: int) -> None:
        self.dataloader = dataloader
        self.num_microbatches = num_microbatches
        self.drop_last = bool(getattr(dataloader, "drop_last", False))
        self.consumed = 0
        self._epoch = 0
        self._skip = 0

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
                    yield group
                index += 1
                group = []
        if group and not self.drop_last and index >= skip:
            yield group

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        finished_epoch = state_dict["consumed"] >= len(self)
        self._skip = 0 if finished_epoch else state_dict["consumed"]
        if not finished_epoch and callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(state_dict["epoch"])


def seed_everything_megatron(seed: int) -> None:
    """Megatron-LM's seeding: a different seed per pipeline stage, Megatron's named model-parallel RNG streams."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed, force_reset_rng=True)


def _reduce_metrics(losses: list[dict[str, torch.Tensor]], device: torch.device, parallel_state: Any) -> dict:
    """Sum `[sum, count]` pairs over microbatches and DP x CP ranks; broadcast from the last pipeline stage."""
    names = sorted(losses[0]) if losses else []
    names = _metric_names_from_last_stage(names, parallel_state)
    totals = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for microbatch_losses in losses:
        for row, name in enumerate(names):
            totals[row] += microbatch_losses[name].to(device, torch.float64).view(2)
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


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {value!r} must be a positive integer")
