"""Push the weights being trained to an inference engine every N optimizer steps, as RL loops need.

Three modes (see `lightning_megatron.serving` and the README section "Serving the trained weights"):
- `disk`: a versioned HF checkpoint under `root` (`v00000010/`, atomic), then `latest` points at it; optionally
  the engine at `engine_url` is told to reload (SGLang `/update_weights_from_disk` or vLLM `update_info {path}`).
- `colocated`: the engine shares the machine (and GPU): buckets go over CUDA IPC (shared memory on the CPU).
- `collective`: a separate process group with the engine (NCCL on GPU, gloo on CPU), SGLang's request shapes.

The version is the global step, saved with the callback's state so that it keeps increasing across a resume.
Tensors go out under the source checkpoint's HF names and in its dtypes (whatever the training precision), the
MTP head included when the model has one, a tied embedding once (as the checkpoint stores it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_megatron.contract import MegatronStrategyContract, megatron_strategy
from lightning_megatron.distributed import agree_on_failure
from lightning_megatron.serving import disk
from lightning_megatron.serving.protocol import WeightSyncError
from lightning_megatron.serving.sender import BucketSender, CollectiveSender, ColocatedSender, SyncReport

Mode = Literal["disk", "colocated", "collective"]
MODES: tuple[Mode, ...] = ("disk", "colocated", "collective")


class WeightSync(pl.Callback):
    """Send the current weights to an inference engine every `every_n_steps` optimizer steps and when training ends.

    `mode`: "disk", "colocated" or "collective" (module docstring). `engine_url`: the engine's HTTP address
    (needed for colocated and collective; optional for disk). `root`: where disk versions go; `keep_last`: how many
    of them stay. `bucket_mb`: the most bytes one request carries (a larger tensor goes alone). `timeout_s`: how
    long one request or broadcast may take before the sync fails (then every rank raises `WeightSyncError` and the
    next sync reconnects). `backend`: the collective's ("auto": NCCL on GPU, gloo on CPU). `engine`: the disk
    notification's shape ("sglang" or "vllm").
    """

    def __init__(
        self,
        mode: Mode = "disk",
        every_n_steps: int = 100,
        engine_url: str | None = None,
        root: str | None = None,
        keep_last: int = 2,
        engine: disk.Engine = "sglang",
        bucket_mb: float = 1024.0,
        timeout_s: float = 300.0,
        backend: Literal["auto", "nccl", "gloo"] = "auto",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "weight_update_group",
        engine_world_size: int = 1,
        sync_on_train_end: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(map(repr, MODES))}")
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps: {every_n_steps!r} must be a positive integer")
        if mode == "disk" and root is None:
            raise ValueError("root: mode 'disk' writes versioned HF folders under root; set root to a folder")
        if mode != "disk" and engine_url is None:
            raise ValueError(f"engine_url: mode {mode!r} sends to a running engine; set engine_url "
                             "(e.g. http://127.0.0.1:30000)")
        if keep_last < 1:
            raise ValueError(f"keep_last: {keep_last} must be at least 1 (the version `latest` names)")
        if bucket_mb <= 0 or timeout_s <= 0:
            raise ValueError(f"bucket_mb ({bucket_mb}) and timeout_s ({timeout_s}) must be positive")
        if engine not in ("sglang", "vllm"):
            raise ValueError(f"engine: {engine!r} is not one of 'sglang', 'vllm'")
        self.mode = mode
        self.every_n_steps = every_n_steps
        self.engine_url = engine_url
        self.root = Path(root) if root is not None else None
        self.keep_last = keep_last
        self.engine = engine
        self.bucket_bytes = int(bucket_mb * 1024**2)
        self.timeout_s = timeout_s
        self.collective_options = dict(backend=backend, master_address=master_address, master_port=master_port,
                                       group_name=group_name, engine_world_size=engine_world_size)
        self.sync_on_train_end = sync_on_train_end
        self.version: int | None = None
        self.reports: list[SyncReport] = []
        self._sender: BucketSender | None = None

    @property
    def state_key(self) -> str:
        """Where the weights go (a disk root, an engine), so that a resumed run finds its own version."""
        return self._generate_state_key(mode=self.mode,
                                        target=str(self.root) if self.mode == "disk" else self.engine_url)

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.version = state_dict.get("version")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        megatron_strategy(trainer, "WeightSync")
        if self.mode == "disk" and trainer.is_global_zero:
            assert self.root is not None
            self.root.mkdir(parents=True, exist_ok=True)
            disk.remove_partials(self.root)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0 and trainer.global_step != self.version:
            self.sync(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sync_on_train_end and trainer.global_step != self.version:
            self.sync(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def sync(self, trainer: pl.Trainer) -> SyncReport:
        """Send the current weights now, as version `trainer.global_step` (every rank calls it)."""
        version = trainer.global_step
        strategy = megatron_strategy(trainer, "WeightSync")
        if self.mode == "disk":
            report = self._sync_to_disk(strategy, version, trainer.is_global_zero)
        else:
            report = self._sync_to_engine(strategy, version, trainer.is_global_zero)
        self.version = version
        self.reports.append(report)
        rank_zero_info(f"WeightSync: version {version} ({self.mode}, {report.bytes / 1e9:.3f} GB, "
                       f"{len(report.requests)} request(s)) in {report.seconds:.2f} s")
        return report

    def _sync_to_disk(self, strategy: MegatronStrategyContract, version: int, is_global_zero: bool) -> SyncReport:
        assert self.root is not None
        started = time.perf_counter()
        folder = disk.version_folder(self.root, version)
        error: BaseException | None = None
        try:
            disk.sync_to_disk(strategy.export_hf, self.root, version, keep_last=self.keep_last,
                              is_leader=is_global_zero, engine_url=self.engine_url, engine=self.engine,
                              timeout_s=self.timeout_s)
        except (WeightSyncError, OSError) as caught:  # the leader's part: the export itself raises on every rank
            error = caught
        agree_on_failure(error, error_type=WeightSyncError)
        report = SyncReport(version, bytes=sum(file.stat().st_size for file in folder.glob("*.safetensors")))
        report.seconds = time.perf_counter() - started
        return report

    def _sync_to_engine(self, strategy: MegatronStrategyContract, version: int, is_global_zero: bool) -> SyncReport:
        from megatron.core.utils import unwrap_model

        if self._sender is None:
            assert self.engine_url is not None
            options = dict(bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s, device=strategy.root_device)
            self._sender = (ColocatedSender(self.engine_url, **options) if self.mode == "colocated"
                            else CollectiveSender(self.engine_url, **options, **self.collective_options))
        bridge = strategy.bridge
        chunks = [unwrap_model(chunk) for chunk in strategy.model_chunks]
        with torch.no_grad():
            tensors = bridge.export_hf_tensors(chunks, on_host=False)  # a GPU model's tensors stay on it
            return self._sender.sync(tensors, bridge.hf_tensor_specs(), version, is_sender=is_global_zero)
