"""Push the weights being trained to an inference engine every N optimizer steps, as RL loops need.

Three modes (see `lightning_megatron.serving` and the README section "Serving the trained weights"):
- `disk`: a versioned HF checkpoint under `root` (`v00000010/`, atomic), then `latest` points at it; optionally
  the engine at `engine_url` is told to reload (SGLang `/update_weights_from_disk` or vLLM `update_info {path}`).
- `colocated`: the engine shares the machine (and GPU): buckets go over CUDA IPC (shared memory on the CPU).
- `collective`: a separate process group with the engine (NCCL on GPU, gloo on CPU), SGLang's request shapes.

The version is the global step, saved with the callback's state so that it keeps increasing across a resume; a fit
resumed at a multiple of `every_n_steps` that its checkpoint records no sync of syncs when training starts.
Tensors go out under the source checkpoint's HF names and in its dtypes (whatever the training precision), the
MTP head included when the model has one, a tied embedding once (as the checkpoint stores it).

Delta syncs (`delta=True`, the default): a sync sends only the HF tensors computed from parameters that required
grad at some step since the last sync (MTP-only training: the MTP head; LoRA: the linears its adapters wrap, merged)
and, where the routers update it, the experts' bias; every other parameter is frozen, so its tensor is what the
engine already holds. A delta goes out only when the engine holds the last version sent (colocated and collective:
its `/model_info`; disk: `latest` names it), the model held that version when this fit started (it resumed at that
very step, or continues the fit that sent it: steps trained in another process are not known) and it changes at
most half of the model's bytes; otherwise the sync is full. A fit that counts its steps afresh starts its versions
afresh. The engine ends bit-equal to a full sync of the same step. A backend that cannot export a subset (mbridge)
always syncs in full. A parameter changed outside the optimizer while frozen is not seen: call `sync(trainer,
full=True)` after such a change.

The draft head's quality per version (`probe=DraftProbe(...)`): before each sync every rank measures the MTP head's
teacher-forced acceptance on the probe set (greedy and sampled at the rollout temperature, per MTP depth), logs it
with the version as the step (`draft_acceptance/greedy_depth1`, ...) and writes it into the version's metadata
(`draft_acceptance`): disk: `weight_version.json` inside the version folder, in place before the folder is renamed
into place; colocated and collective: the last request's `weight_version_metadata`, which the engine keeps with the
version (the package's receiver answers it in `/model_info`). A rollout worker reads which head quality it serves
(`lightning_megatron.serving.served_version`). Put `WeightSync` after `MTPOnlyCallback` in the callbacks.

LoRA: `lora_form="merged"` (the default) sends the adapted linears with their adapters merged in (a delta of only
those); `lora_form="adapter"` (disk) writes each version as a PEFT folder of the adapters alone, for engines that
serve LoRA adapters over the base model they hold (SGLang `/load_lora_adapter`, vLLM `/v1/load_lora_adapter`,
told with the folder's name as the adapter's). Adapters that form cannot name (a checkpoint that stores its experts
fused, Qwen3.5-MoE's, has no tensor per expert) are refused when the fit starts, before the first step.
"""

from __future__ import annotations

import json
import math
import time
from functools import partial
from pathlib import Path
from typing import Any, Literal, override
from urllib.parse import urlsplit

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_megatron.atomic import wait_for_removals
from lightning_megatron.bridges import Bridge
from lightning_megatron.callbacks.lora import LoRACallback
from lightning_megatron.contract import MegatronLightningModule, MegatronStrategyContract, megatron_strategy
from lightning_megatron.data.settings import hand_data_settings
from lightning_megatron.distributed import agree_on_failure, leader_value
from lightning_megatron.lora import check_adapter_form, export_lora_adapter
from lightning_megatron.mtp.probe import DraftProbe
from lightning_megatron.serving import disk
from lightning_megatron.serving.protocol import WeightSyncError, version_record
from lightning_megatron.serving.sender import BucketSender, CollectiveSender, ColocatedSender, SyncReport

Mode = Literal["disk", "colocated", "collective"]
MODES: tuple[Mode, ...] = ("disk", "colocated", "collective")
LoRAForm = Literal["merged", "adapter"]


class WeightSync(pl.Callback):
    """Send the current weights to an inference engine every `every_n_steps` optimizer steps and when training ends.

    Args:
        mode: "disk", "colocated" or "collective" (module docstring).
        every_n_steps: optimizer steps between two syncs (an integer >= 1).
        engine_url: the engine's HTTP address (needed for colocated and collective; optional for disk).
        root: where disk versions go (disk only).
        keep_last: how many disk versions stay, the one `latest` names included.
        engine: the disk notification's shape ("sglang" or "vllm").
        bucket_mb: the most bytes one request carries, in MiB (a larger tensor goes alone).
        timeout_s: how long one request or broadcast may take before the sync fails (then every rank raises
            `WeightSyncError` and the next sync reconnects).
        backend: the collective's ("auto": NCCL on GPU, gloo on CPU).
        master_address: (collective) the address of the weight-update group's TCP rendezvous, which this process
            (rank 0 of the group) hosts.
        master_port: (collective) its port (0: a free one).
        group_name: (collective) the weight-update group's name, as the engine's requests name it.
        engine_world_size: (collective) the engine's processes in the update group.
        sync_on_train_end: sync once more when training ends, unless the last step was just synced.
        delta: send only what changed since the engine's version (module docstring).
        lora_form: a LoRA model's weights "merged", or its adapters alone as PEFT folders ("adapter", disk only).
        probe: a `DraftProbe`: measure the draft head's acceptance at each version and record it with the version
            (module docstring).
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
        delta: bool = True,
        lora_form: LoRAForm = "merged",
        probe: DraftProbe | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(map(repr, MODES))}")
        _check_positive_integer("every_n_steps", every_n_steps, "optimizer steps between two syncs")
        _check_positive_integer("keep_last", keep_last, "versions kept on the disk, the one `latest` names included")
        if mode == "disk" and (root is None or str(root) == ""):
            raise ValueError("root: mode 'disk' writes versioned HF folders under root; set root to a folder")
        if mode != "disk" and root is not None:
            raise ValueError(f"root: mode {mode!r} sends the weights to the engine and writes nothing under root; "
                             "leave root unset, or use mode='disk'")
        if mode != "disk" and engine_url is None:
            raise ValueError(f"engine_url: mode {mode!r} sends to a running engine; set engine_url "
                             "(e.g. http://127.0.0.1:30000)")
        if engine_url is not None and not (isinstance(engine_url, str)
                                           and engine_url.startswith(("http://", "https://"))
                                           and urlsplit(engine_url).hostname):
            raise ValueError(f"engine_url: {engine_url!r} is not an HTTP address; write it as http://HOST:PORT")
        _check_positive_number("bucket_mb", bucket_mb, "the most MiB one request carries, e.g. 1024")
        if int(bucket_mb * 1024**2) < 1:
            raise ValueError(f"bucket_mb: {bucket_mb!r} is less than one byte; give the MiB one request carries, "
                             "e.g. 1024")
        _check_positive_number("timeout_s", timeout_s, "the seconds one request or broadcast may take, e.g. 300")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 <= master_port <= 65535:
            raise ValueError(f"master_port: {master_port!r} is not a TCP port; give an integer in 1..65535, or 0 "
                             "for a free one")
        if not (isinstance(master_address, str) and master_address):
            raise ValueError(f"master_address: {master_address!r} is not a host; give the address the engine "
                             "reaches this process at, e.g. 127.0.0.1")
        if engine not in ("sglang", "vllm"):
            raise ValueError(f"engine: {engine!r} is not one of 'sglang', 'vllm'")
        if engine == "vllm" and mode != "disk":  # it would be ignored: a vLLM engine answers SGLang's routes with 404
            raise ValueError(f"engine: 'vllm' shapes the disk mode's requests; mode {mode!r} sends SGLang's "
                             "requests (or the package's receiver); use mode='disk' for a vLLM engine")
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend: {backend!r} is not one of 'auto', 'nccl', 'gloo'")
        _check_positive_integer("engine_world_size", engine_world_size, "the engine's processes in the update group")
        for name, value in (("delta", delta), ("sync_on_train_end", sync_on_train_end)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: {value!r} must be true or false")
        if lora_form not in ("merged", "adapter"):
            raise ValueError(f"lora_form: {lora_form!r} is not one of 'merged', 'adapter'")
        if lora_form == "adapter" and mode != "disk":
            raise ValueError("lora_form: 'adapter' writes PEFT folders for engines that load LoRA adapters from disk; "
                             "use mode='disk', or lora_form='merged' to send the merged weights")
        if probe is not None and not isinstance(probe, DraftProbe):
            raise ValueError(f"probe: {probe!r} is not a DraftProbe; give DraftProbe(batches=..., temperature=...) "
                             "or leave probe unset")
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
        self.delta = delta
        self.lora_form = lora_form
        self.probe = probe
        self.version: int | None = None
        self.reports: list[SyncReport] = []
        self._sender: BucketSender | None = None
        self._trained: set[int] = set()  # ids of the parameters that required grad at a step since the last sync
        self._holds_version = False  # whether the model's weights are `version`'s plus only the steps noted since

    @property
    @override
    def state_key(self) -> str:
        """Where the weights go (a disk root, an engine), so that a resumed run finds its own version."""
        return self._generate_state_key(mode=self.mode,
                                        target=str(self.root) if self.mode == "disk" else self.engine_url)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.version = state_dict.get("version")

    def validate_megatron_setup(self, strategy: MegatronStrategyContract, module: MegatronLightningModule) -> None:
        """Called by MegatronStrategy before the model is built: a probe needs a draft head, the adapter form a LoRA
        run (refused now, not at the first sync after training steps); only a fit syncs."""
        if module.trainer.state.fn != TrainerFn.FITTING:
            return
        if self.probe is not None and not module.model_options().mtp:
            raise ValueError(f"probe: DraftProbe measures the draft (MTP) head, but {type(module).__name__} has none "
                             "(enable_mtp: false); set SFTModule(enable_mtp=True) on a checkpoint with an MTP head, "
                             "or leave probe unset")
        if self.probe is not None:  # a probe set of its own reads rows as the trainer's data module does
            hand_data_settings(self.probe.datamodule, strategy.data_settings(module))
        if self.lora_form == "adapter" and not any(isinstance(callback, LoRACallback)
                                                   for callback in module.trainer.callbacks):
            raise ValueError("lora_form: 'adapter' writes the LoRA adapters, but this run trains none (no "
                             "LoRACallback among the callbacks); add LoRACallback(...), or use lora_form='merged'")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        strategy = megatron_strategy(trainer, "WeightSync")
        if self.lora_form == "adapter":  # adapters the PEFT form cannot name: refused now, not at the first sync
            check_adapter_form(strategy.bridge, [unwrap_model(chunk) for chunk in strategy.model_chunks])
        if self.probe is not None:
            self.probe.check_data(trainer)  # no probe set: refused now, not at the first sync
        if self.mode == "disk" and trainer.is_global_zero:
            assert self.root is not None
            self.root.mkdir(parents=True, exist_ok=True)
            disk.remove_partials(self.root)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.version is not None and trainer.global_step < self.version:
            self.version = None  # a fit that counts its steps afresh (not resumed from this run): versions afresh too
        # the weights are `version`'s only when training starts at that very step (resumed from a checkpoint taken
        # at the sync, or a fit continuing the last one); steps trained since in another fit or process are unknown
        self._holds_version = trainer.global_step == self.version
        if trainer.global_step > 0 and trainer.global_step % self.every_n_steps == 0 and not self._holds_version:
            # resumed at a step whose sync the checkpoint does not record (a callback before this one saved it and
            # ended the run, as PreemptionCheckpoint does): that version is sent now, not skipped
            self.sync(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._note_trained(trainer)
        if trainer.global_step % self.every_n_steps == 0 and trainer.global_step != self.version:
            self.sync(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sync_on_train_end and trainer.global_step != self.version:
            self.sync(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        wait_for_removals()  # the fit ends with the versions it pruned deleted, not only out of sight

    def sync(self, trainer: pl.Trainer, *, full: bool = False) -> SyncReport:
        """Send the current weights now, as version `trainer.global_step` (every rank calls it); `full`: every
        tensor, even where a delta would do."""
        from megatron.core.utils import unwrap_model

        version = trainer.global_step
        strategy = megatron_strategy(trainer, "WeightSync")
        chunks = [unwrap_model(chunk) for chunk in strategy.model_chunks]
        self._note_trained(trainer)
        changing = None if full else self._changing_tensors(strategy.bridge, chunks)
        metadata = self._measure(trainer, version)
        with torch.no_grad():  # a GPU model's export broadcasts its (grad-requiring) parameters in place
            if self.lora_form == "adapter":
                report = self._sync_adapter_to_disk(strategy, version, metadata, trainer.is_global_zero)
            elif self.mode == "disk":
                report = self._sync_to_disk(strategy.bridge, chunks, version, changing, metadata,
                                            trainer.is_global_zero)
            else:
                report = self._sync_to_engine(strategy.bridge, chunks, version, changing, metadata,
                                              trainer.is_global_zero, strategy.root_device)
        self.version = version
        self._trained = set()
        self._holds_version = True
        self.reports.append(report)
        delta = "" if report.base_version is None else f", delta onto version {report.base_version}"
        size = f"{report.bytes / 1e9:.3f} GB" if report.bytes >= 1e9 else f"{report.bytes / 1e6:.3f} MB"
        requests = "" if self.mode == "disk" else f", {len(report.requests)} request(s)"  # disk: files, no requests
        rank_zero_info(f"WeightSync: version {version} ({self.mode}{delta}, {size}{requests}) in "
                       f"{report.seconds:.2f} s")
        return report

    def _measure(self, trainer: pl.Trainer, version: int) -> dict[str, Any]:
        """What the version's metadata records beside the weights: the draft head's acceptance, when probed (every
        rank measures; the loggers get it with the version as the step)."""
        if self.probe is None:
            return {}
        acceptance = self.probe.measure(trainer, trainer.lightning_module)
        for logger in trainer.loggers:
            logger.log_metrics(acceptance.as_metrics(), step=version)
        return {"draft_acceptance": acceptance.as_json()}

    # ------------------------------------------------------------------ what changed

    def _note_trained(self, trainer: pl.Trainer) -> None:
        strategy = megatron_strategy(trainer, "WeightSync")
        self._trained.update(id(parameter) for chunk in strategy.model_chunks for parameter in chunk.parameters()
                             if parameter.requires_grad)

    def _changing_tensors(self, bridge: Bridge, chunks: list[torch.nn.Module]) -> set[str] | None:
        """The HF tensors that may have changed since the last sync (every rank calls it); None: unknown (every
        tensor), as with `delta=False` or a backend that cannot export a subset."""
        if not self.delta or not bridge.exports_selected_tensors:
            return None
        from megatron.core.utils import get_model_config

        changed = set(self._trained)
        config = get_model_config(chunks[0])
        if config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate > 0:  # updated without grad
            changed.update(id(buffer) for chunk in chunks for name, buffer in chunk.named_buffers()
                           if name.endswith("expert_bias"))
        return bridge.changed_hf_names(chunks, changed) & set(bridge.hf_tensor_specs())

    def _delta_is_worth_it(self, bridge: Bridge, changing: set[str] | None) -> bool:
        """A delta needs the version it applies onto (held by the model but for the steps noted since) and must leave
        at least half of the model's bytes unsent."""
        if not changing or self.version is None or not self._holds_version:
            return False  # nothing trained (a full sync still moves the engine's version), or no version to apply onto
        specs = bridge.hf_tensor_specs()
        return 2 * sum(specs[name].nbytes for name in changing) <= sum(spec.nbytes for spec in specs.values())

    # ------------------------------------------------------------------ the three modes

    def _sync_to_disk(self, bridge: Bridge, chunks: list[torch.nn.Module], version: int,
                      changing: set[str] | None, metadata: dict[str, Any], is_global_zero: bool) -> SyncReport:
        assert self.root is not None
        started = time.perf_counter()
        base = None
        if self._delta_is_worth_it(bridge, changing):
            assert changing is not None
            base = leader_value(disk.delta_base(self.root, self.version, changing, bridge.hf_tensor_specs())
                                if is_global_zero else None)
        report = SyncReport(version, base_version=None if base is None else self.version, metadata=metadata)
        extra_files = {disk.VERSION_FILE: json.dumps(version_record(version, report.base_version, report.metadata),
                                                     indent=2) + "\n"}

        def save(folder: Path) -> Path:
            if base is None:  # the tensors that change get shard files of their own: the next version links the rest
                return bridge.save_hf(chunks, folder, separate=changing or (), extra_files=extra_files)
            assert changing is not None
            specs = {name: spec for name, spec in bridge.hf_tensor_specs().items() if name in changing}
            # a GPU model's tensors stay on it: the writer stages them from there, overlapping the export
            tensors = bridge.export_hf_tensors(chunks, only=changing, on_host=False)
            try:
                if is_global_zero:
                    disk.write_delta_version(base, folder, specs, tensors, extra_files)
            finally:
                for _ in tensors:  # every rank iterates the export to its end (its collectives), the leader too
                    pass
            report.bytes = sum(spec.nbytes for spec in specs.values())
            return folder

        error: BaseException | None = None
        try:
            folder = disk.sync_to_disk(save, self.root, version, keep_last=self.keep_last, is_leader=is_global_zero,
                                       engine_url=self.engine_url, engine=self.engine, timeout_s=self.timeout_s)
            if base is None:
                report.bytes = sum(file.stat().st_size for file in folder.glob("*.safetensors"))
        except (WeightSyncError, OSError) as caught:  # the leader's part: the export itself raises on every rank
            error = caught
        agree_on_failure(error, error_type=WeightSyncError)
        report.seconds = time.perf_counter() - started
        return report

    def _sync_adapter_to_disk(self, strategy: MegatronStrategyContract, version: int, metadata: dict[str, Any],
                              is_global_zero: bool) -> SyncReport:
        assert self.root is not None
        started = time.perf_counter()
        report = SyncReport(version, metadata=metadata)
        extra_files = {disk.VERSION_FILE: json.dumps(version_record(version, None, report.metadata), indent=2) + "\n"}
        error: BaseException | None = None
        try:
            folder = disk.sync_to_disk(partial(export_lora_adapter, strategy, extra_files=extra_files), self.root,
                                       version, keep_last=self.keep_last, is_leader=is_global_zero,
                                       engine_url=self.engine_url, engine=self.engine, timeout_s=self.timeout_s,
                                       adapter=True)
            report.bytes = sum(file.stat().st_size for file in folder.glob("*.safetensors"))
        except (WeightSyncError, OSError) as caught:
            error = caught
        agree_on_failure(error, error_type=WeightSyncError)
        report.seconds = time.perf_counter() - started
        return report

    def _sync_to_engine(self, bridge: Bridge, chunks: list[torch.nn.Module], version: int,
                        changing: set[str] | None, metadata: dict[str, Any], is_global_zero: bool,
                        device: torch.device) -> SyncReport:
        if self._sender is None:
            assert self.engine_url is not None
            options = dict(bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s, device=device)
            self._sender = (ColocatedSender(self.engine_url, **options) if self.mode == "colocated"
                            else CollectiveSender(self.engine_url, **options, **self.collective_options))
        base_version = None
        if self._delta_is_worth_it(bridge, changing):
            held = leader_value(self._engine_version() if is_global_zero else None)
            base_version = self.version if held == str(self.version) else None  # a restarted engine: in full
        specs = bridge.hf_tensor_specs()
        only = changing if base_version is not None else None
        if only is not None:
            specs = {name: specs[name] for name in only}
        tensors = bridge.export_hf_tensors(chunks, on_host=False, only=only)  # a GPU model's tensors stay on it
        return self._sender.sync(tensors, specs, version, is_sender=is_global_zero, base_version=base_version,
                                 metadata=metadata)

    def _engine_version(self) -> str | None:
        assert self._sender is not None
        try:
            return self._sender.engine_version()
        except WeightSyncError:  # an engine that cannot say: a full sync (which reports what is wrong)
            return None


def _check_positive_number(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: {value!r} must be a finite number > 0 ({meaning})")


def _check_positive_integer(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {value!r} must be an integer >= 1 ({meaning})")
