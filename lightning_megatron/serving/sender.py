"""Send a model's HF tensors to a running inference engine in buckets: `colocated` (shared memory) or `collective`.

Every rank iterates the export (it gathers across TP/PP in lockstep); global rank 0 alone sends. Tensors are
copied into one staging buffer of `bucket_bytes` as they arrive and each full buffer goes out as one request
(a tensor larger than a bucket goes alone, from its own memory), so the sender holds at most one bucket, the
tensor being exported and one oversize tensor held back so that the last request can carry `weight_version`.
A delta (`base_version`) carries only the tensors that changed since the version the engine holds, each request
naming that version (`base_weight_version`); the engine applies it only onto that version. The engine checks a
sync's names, dtypes and shapes before any byte moves (`/validate_weights`), except a delta's whose tensors it
accepted in this sender's last syncs (one round trip less: a small delta's time is mostly round trips). The last request
carries `weight_version` and the version's metadata (`weight_version_metadata`).
A failure on rank 0 (a dead engine, a timeout) does not stop the iteration there: the other ranks would wait in
the export's collectives. Rank 0 stops sending, drains the export, and then every rank raises `WeightSyncError`
together; the next sync starts afresh (a new update group).
"""

from __future__ import annotations

import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from lightning_megatron.distributed import agree_on_failure
from lightning_megatron.hf_io import TensorSpec
from lightning_megatron.serving.protocol import (
    SharedBuffer,
    WeightSyncError,
    as_bytes,
    broadcast,
    destroy_process_group,
    flattened_metadata,
    get_json,
    init_custom_process_group,
    post_json,
    serialize,
    specs_payload,
    version_record,
)


@dataclass
class SyncReport:
    """What one sync sent: per request, the names it carried (in order)."""

    version: int
    requests: list[list[str]] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    base_version: int | None = None  # a delta onto this version; None: a full sync
    metadata: dict[str, Any] = field(default_factory=dict)  # what was measured at this version (the draft probe)


class BucketSender(ABC):
    """Streams HF tensors to the engine at `url` in requests of at most `bucket_bytes` (see the module docstring)."""

    def __init__(self, url: str, *, bucket_bytes: int, timeout_s: float, device: torch.device) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: {bucket_bytes} must be positive")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: {timeout_s} must be positive")
        self.url = url.rstrip("/")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.device = device
        self._staging: Any = None
        self._staging_size = bucket_bytes
        self._fields: dict[str, Any] = {}
        self._record: dict[str, Any] = {}
        self._sent_version: str | None = None  # the last version this sender completed
        # the names, dtypes and shapes the engine accepted for the syncs this sender completed since it last
        # failed (None: none, or the last sync did not complete); a delta among them needs no check again
        self._accepted: set[TensorSpec] | None = None

    def engine_version(self) -> str | None:
        """The weight version the engine holds now (None: none yet, e.g. a restarted engine)."""
        version = get_json(f"{self.url}/model_info", self.timeout_s).get("weight_version")
        return None if version is None else str(version)

    def sync(self, tensors: Iterable[tuple[str, torch.Tensor]], specs: Mapping[str, TensorSpec], version: int, *,
             is_sender: bool, base_version: int | None = None,
             metadata: Mapping[str, Any] | None = None) -> SyncReport:
        """Send every tensor of `tensors`, named in `specs` (all ranks call it with the export; `is_sender` on one
        of them); with `base_version`, they are a delta onto that version."""
        report = SyncReport(version, base_version=base_version, metadata=dict(metadata or {}))
        self._fields = ({} if base_version is None else {"base_weight_version": str(base_version)})
        self._record = version_record(version, base_version, metadata)
        # a model smaller than a bucket needs no more staging memory than itself
        self._staging_size = min(self.bucket_bytes, sum(spec.nbytes for spec in specs.values()))
        started = time.perf_counter()
        failure: BaseException | None = None
        accepted, self._accepted = self._accepted, None  # set again only once this sync completes
        # a delta goes onto the version this sender sent last, in tensors the engine accepted then: its requests are
        # checked by the engine one by one, and an engine that holds another version refuses them unapplied
        known = (base_version is not None and str(base_version) == self._sent_version and accepted is not None
                 and set(specs.values()) <= accepted)
        if is_sender:
            try:
                self._prepare(list(specs.values()), check=not known)
            except (WeightSyncError, OSError, RuntimeError) as error:
                failure = _as_sync_error(error)
        # a refused manifest stops every rank before any byte moves
        agree_on_failure(failure, error_type=WeightSyncError)
        bucket: list[TensorSpec] = []
        used = 0
        held_back: tuple[TensorSpec, torch.Tensor] | None = None
        for name, tensor in tensors:
            spec = specs.get(name)
            if spec is None:
                raise WeightSyncError(f"the export carries {name}, which the source checkpoint does not have")
            if not is_sender or failure is not None:
                continue
            try:
                if held_back is not None:
                    self._send_one(report, *held_back, version=None)
                    held_back = None
                if spec.nbytes > self.bucket_bytes:
                    held_back = (spec, tensor)
                    continue
                if used + spec.nbytes > self.bucket_bytes:
                    self._send(report, bucket, self._staging_bytes(used), used, version=None)
                    bucket, used = [], 0
                self._stage(tensor, used)
                bucket.append(spec)
                used += spec.nbytes
            except (WeightSyncError, OSError, RuntimeError) as error:
                failure = _as_sync_error(error)
        if is_sender and failure is None:
            try:
                if held_back is not None:
                    self._send_one(report, *held_back, version=None if bucket else version)
                if bucket:
                    self._send(report, bucket, self._staging_bytes(used), used, version=version)
            except (WeightSyncError, OSError, RuntimeError) as error:
                failure = _as_sync_error(error)
        if failure is not None:
            self._reset()
        agree_on_failure(failure, error_type=WeightSyncError)
        self._sent_version = str(version)
        self._accepted = accepted if known else set(specs.values())
        report.seconds = time.perf_counter() - started
        return report

    def close(self) -> None:
        self._reset()
        self._release_staging()
        self._accepted = None

    def _release_staging(self) -> None:
        if isinstance(self._staging, SharedBuffer):
            self._staging.close()
        self._staging = None

    # ------------------------------------------------------------------ buckets

    def _stage(self, tensor: torch.Tensor, offset: int) -> None:
        if self._staging is not None and _capacity(self._staging) < self._staging_size:
            self._release_staging()  # sized for a smaller sync (a delta) than this one (a full sync)
        if self._staging is None:
            self._staging = self._new_buffer(self._staging_size)
        staging = self._staging.tensor if isinstance(self._staging, SharedBuffer) else self._staging
        data = as_bytes(tensor)
        staging[offset:offset + data.numel()].copy_(data, non_blocking=True)

    def _staging_bytes(self, used: int) -> Any:
        return self._staging

    def _send_one(self, report: SyncReport, spec: TensorSpec, tensor: torch.Tensor, *, version: int | None) -> None:
        """A tensor larger than a bucket, from its own memory."""
        self._send(report, [spec], self._oversize(tensor), spec.nbytes, version=version)

    def _send(self, report: SyncReport, specs: list[TensorSpec], data: Any, nbytes: int, *,
              version: int | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the staging copies are done
        fields = dict(self._fields)
        if version is not None:  # the last request: the version is complete once the engine has taken it
            fields.update(weight_version=str(version), weight_version_metadata=self._record)
        self._request(specs, data, nbytes, fields)
        report.requests.append([spec.name for spec in specs])
        report.bytes += nbytes

    @abstractmethod
    def _new_buffer(self, nbytes: int) -> Any: ...

    @abstractmethod
    def _oversize(self, tensor: torch.Tensor) -> Any: ...

    @abstractmethod
    def _prepare(self, specs: list[TensorSpec], *, check: bool) -> None:
        """Before any byte moves: connect, and (`check`) have the engine check every name, dtype and shape."""

    @abstractmethod
    def _request(self, specs: list[TensorSpec], data: Any, nbytes: int, fields: dict[str, Any]) -> None:
        """Send one bucket; `fields` go into the request as they are (the version fields)."""

    def _reset(self) -> None:
        """Forget the connection after a failure (the next sync reconnects)."""

    def _validate(self, specs: list[TensorSpec]) -> None:
        """The engine checks the whole manifest (an engine without `/validate_weights` checks each request)."""
        try:
            post_json(f"{self.url}/validate_weights", specs_payload(specs), self.timeout_s)
        except WeightSyncError as error:
            if "answered 404" not in str(error):
                raise


class ColocatedSender(BucketSender):
    """The engine shares this machine (and GPU): each bucket is handed over as a CUDA IPC handle (a shared-memory
    file on the CPU) in SGLang's `update_weights_from_tensor` request; the engine copies it out before replying,
    so the staging buffer is reused without a copy through host memory."""

    def _new_buffer(self, nbytes: int) -> SharedBuffer:
        return SharedBuffer(nbytes, self.device)

    def _oversize(self, tensor: torch.Tensor) -> Any:
        if tensor.is_cuda:
            return as_bytes(tensor)  # its own IPC handle
        buffer = SharedBuffer(tensor.nbytes, tensor.device)
        buffer.tensor[:tensor.nbytes].copy_(as_bytes(tensor))
        return buffer

    def _prepare(self, specs: list[TensorSpec], *, check: bool) -> None:
        if check:
            self._validate(specs)

    def _request(self, specs: list[TensorSpec], data: Any, nbytes: int, fields: dict[str, Any]) -> None:
        handle = data.handle(nbytes) if isinstance(data, SharedBuffer) else data
        payload = {"flattened_tensor": handle, "metadata": flattened_metadata(specs)}
        try:
            post_json(f"{self.url}/update_weights_from_tensor",
                      {"serialized_named_tensors": [serialize(payload)], "load_format": "flattened_bucket",
                       "flush_cache": True, "weight_version": None, **fields}, self.timeout_s)
        finally:
            if isinstance(data, SharedBuffer) and data is not self._staging:
                data.close()


class CollectiveSender(BucketSender):
    """A separate process group with the engine (NCCL on GPU, gloo on CPU): per bucket, SGLang's
    `update_weights_from_distributed` request with `load_format="flattened_bucket"` is posted while the bucket is
    broadcast from this process (rank 0 of the group), both bounded by `timeout_s`. An engine that no longer holds
    the version last sent (restarted: its end of the group is gone) gets a new group before the next sync."""

    def __init__(self, url: str, *, bucket_bytes: int, timeout_s: float, device: torch.device,
                 backend: str = "auto", master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str = "weight_update_group", engine_world_size: int = 1) -> None:
        super().__init__(url, bucket_bytes=bucket_bytes, timeout_s=timeout_s, device=device)
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend: {backend!r} is not one of 'auto', 'nccl', 'gloo'")
        if engine_world_size < 1:
            raise ValueError(f"engine_world_size: {engine_world_size} must be positive")
        self.backend = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.engine_world_size = engine_world_size
        self._group: Any = None

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _oversize(self, tensor: torch.Tensor) -> torch.Tensor:
        return as_bytes(tensor)

    def _staging_bytes(self, used: int) -> torch.Tensor:
        return self._staging[:used]

    def _prepare(self, specs: list[TensorSpec], *, check: bool) -> None:
        if self._group is not None and self.engine_version() != self._sent_version:
            self._reset()  # the engine restarted since (its end of the group is gone, its version too): a new group
        if self._group is None:
            port = self.master_port or _free_port(self.master_address)
            request = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                       "world_size": 1 + self.engine_world_size, "group_name": self.group_name,
                       "backend": self.backend}
            reply = _in_background(lambda: post_json(f"{self.url}/init_weights_update_group", request, self.timeout_s))
            self._group = init_custom_process_group(self.backend, self.master_address, port, 0,
                                                    1 + self.engine_world_size, self.group_name,
                                                    timedelta(seconds=self.timeout_s))
            reply.result(self.timeout_s)
            check = True  # a new group: the engine may be another one than the sender's last syncs went to
        if check:
            self._validate(specs)

    def _request(self, specs: list[TensorSpec], data: torch.Tensor, nbytes: int, fields: dict[str, Any]) -> None:
        payload = {**specs_payload(specs), "group_name": self.group_name, "flush_cache": True,
                   "weight_version": None, "load_format": "flattened_bucket", **fields}
        reply = _in_background(lambda: post_json(f"{self.url}/update_weights_from_distributed", payload,
                                                 self.timeout_s))
        try:
            broadcast(self._group, data[:nbytes], self.timeout_s)
        except WeightSyncError as error:
            reply.result(1.0, default_error=error)  # the engine's own reason, when it gave one
            raise
        reply.result(self.timeout_s)

    def _reset(self) -> None:
        if self._group is not None:
            group, self._group = self._group, None
            destroy_process_group(group)


class _Background:
    """A call running on a daemon thread; `result` waits at most `timeout_s` for it."""

    def __init__(self, call: Any) -> None:
        self._outcome: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Any) -> None:
        try:
            self._outcome.append((call(), None))
        except BaseException as error:  # handed to `result`
            self._outcome.append((None, error))

    def result(self, timeout_s: float, default_error: BaseException | None = None) -> Any:
        self._thread.join(timeout_s)
        if not self._outcome:
            if default_error is not None:
                return None
            raise WeightSyncError(f"the engine did not answer within {timeout_s} s")
        value, error = self._outcome[0]
        if error is not None:
            raise error
        return value


def _capacity(staging: Any) -> int:
    return staging.nbytes if isinstance(staging, SharedBuffer) else staging.numel()


def _as_sync_error(error: BaseException) -> WeightSyncError:
    if isinstance(error, WeightSyncError):
        return error
    wrapped = WeightSyncError(f"{type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def _in_background(call: Any) -> _Background:
    return _Background(call)


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
