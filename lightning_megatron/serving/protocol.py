"""The wire between a trainer and an inference engine, shared by the sender and the receiver helper.

Request shapes are SGLang's (`python/sglang/srt/managers/io_struct.py`): `init_weights_update_group`,
`update_weights_from_distributed` (names, dtypes, shapes; `load_format="flattened_bucket"`: the tensors' bytes
concatenated in `names` order, no padding, broadcast as one uint8 buffer), `update_weights_from_tensor`
(`serialized_named_tensors`: one base64 pickle per engine TP rank; CUDA tensors pickle to CUDA IPC handles, so
a colocated engine maps the sender's memory without a copy through the host) and `update_weights_from_disk`.
The weight-update group is built as SGLang builds it (a TCP rendezvous, then a `PrefixStore(group_name)`), so the
same sender talks to this package's receiver and to an SGLang server.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
import threading
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.hf_io import TensorSpec


class WeightSyncError(RuntimeError):
    """A weight update that did not complete: the engine's weights may be partly updated and must be re-synced."""


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype: `torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r}")
    return dtype


def specs_payload(specs: Sequence[TensorSpec]) -> dict[str, list]:
    """The `names`, `dtypes`, `shapes` fields of SGLang's requests."""
    return {"names": [spec.name for spec in specs], "dtypes": [dtype_name(spec.dtype) for spec in specs],
            "shapes": [list(spec.shape) for spec in specs]}


def specs_from_payload(payload: dict[str, Any]) -> list[TensorSpec]:
    names, dtypes, shapes = payload["names"], payload["dtypes"], payload["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightSyncError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                              f"{len(shapes)})")
    return [TensorSpec(name, tuple(shape), dtype_from_name(dtype)) for name, dtype, shape in zip(names, dtypes, shapes)]


def flattened_metadata(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    """Where each tensor lies in a flattened bucket (byte offsets, in order, no padding)."""
    metadata, start = [], 0
    for spec in specs:
        metadata.append({"name": spec.name, "shape": list(spec.shape), "dtype": dtype_name(spec.dtype),
                         "start_idx": start, "end_idx": start + spec.nbytes})
        start += spec.nbytes
    return metadata


def unflatten(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a flattened uint8 bucket, as views where the offset allows (else as aligned copies)."""
    start = 0
    for spec in specs:
        piece = buffer[start:start + spec.nbytes]
        element_size = torch.empty((), dtype=spec.dtype).element_size()
        if (piece.data_ptr() % element_size) != 0:
            piece = piece.clone()
        yield spec.name, piece.view(spec.dtype).reshape(spec.shape)
        start += spec.nbytes


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------------- the update group


def init_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout: timedelta) -> Any:
    """A process group apart from the default one, joined by the trainer (rank 0) and the engine's workers.

    Built as SGLang's `init_custom_process_group` builds it, so that an SGLang worker and this one meet under the
    same store keys; the trainer's own default group is untouched.
    """
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    return group


def destroy_process_group(group: Any) -> None:
    """Drop a weight-update group, also one whose peer died (an abort, not a collective shutdown)."""
    abort = getattr(group, "abort", None)
    if callable(abort):
        with contextlib.suppress(RuntimeError):  # not every backend can abort
            abort()
    dist.destroy_process_group(group)


def broadcast(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast from the group's rank 0, raising `WeightSyncError` when it has not finished after `timeout_s`.

    The collective runs on a worker thread: a raw NCCL broadcast has no timeout of its own (a dead peer would
    hang the caller), so the caller waits on the thread and gives up on time.
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            dist.broadcast(tensor, group=group, group_src=0)
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()
            outcome.append(None)
        except BaseException as error:  # reported to the caller below
            outcome.append(error)

    worker = threading.Thread(target=run, name="weight-sync-broadcast", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise WeightSyncError(f"a broadcast of {tensor.nbytes} bytes did not finish within {timeout_s} s")
    if outcome[0] is not None:
        raise WeightSyncError(f"the broadcast failed: {outcome[0]}") from outcome[0]


# ---------------------------------------------------------------------------------------------- shared buffers


class SharedBuffer:
    """A uint8 buffer another process on the same machine can map: device memory on a GPU (CUDA IPC), a file in
    shared memory (`/dev/shm`) on the CPU."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.path: Path | None = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
            self.path = folder / f"lightning-megatron-weights-{os.getpid()}-{uuid.uuid4().hex}"
            # unlinked when closed, collected, or at exit: a sync on demand after fit (no teardown) leaves no file
            self._unlink = weakref.finalize(self, self.path.unlink, missing_ok=True)
            self.tensor = torch.from_file(str(self.path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)

    def handle(self, nbytes: int) -> Any:
        """What a receiver needs to map the first `nbytes` (picklable; a CUDA tensor pickles to an IPC handle)."""
        if self.path is None:
            return self.tensor[:nbytes]
        return {"shared_file": str(self.path), "nbytes": nbytes}

    def close(self) -> None:
        if self.path is not None:
            self._unlink()


def open_handle(handle: Any) -> torch.Tensor:
    """The receiver's view of a `SharedBuffer.handle` (a CUDA tensor arrives already mapped)."""
    if isinstance(handle, dict):
        return torch.from_file(handle["shared_file"], shared=False, size=handle["nbytes"], dtype=torch.uint8)
    return handle


def serialize(obj: Any) -> str:
    """base64 of a pickle in which CUDA tensors become IPC handles (SGLang's `MultiprocessingSerializer`)."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def deserialize(text: str) -> Any:
    """Only for requests from the trainer on this machine: the receiver listens on 127.0.0.1 (a pickle runs code)."""
    return pickle.loads(base64.b64decode(text))


def version_record(version: int, base_version: int | None, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a version's metadata holds (`weight_version.json` on disk, `weight_version_metadata` on the wire): the
    version, the version it is a delta of (None: a full sync) and what the trainer measured at it. JSON-safe."""
    return {"version": version, "base_version": base_version, **(metadata or {})}


# ---------------------------------------------------------------------------------------------- HTTP


def get_json(url: str, timeout_s: float) -> dict[str, Any]:
    """GET a JSON reply (SGLang's `/model_info`), or `WeightSyncError` with the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        raise WeightSyncError(f"{url} answered {error.code}: {error.read().decode(errors='replace')[:500]}") from error
    except (urllib.error.URLError, OSError) as error:
        raise WeightSyncError(f"{url} did not answer: {error}") from error


def post_json(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST `payload` as JSON; the engine's reply, or `WeightSyncError` with its message."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        raise WeightSyncError(f"{url} answered {error.code}: {error.read().decode(errors='replace')[:500]}") from error
    except (urllib.error.URLError, OSError) as error:
        raise WeightSyncError(f"{url} did not answer: {error}") from error
    reply = json.loads(body) if body else {}
    if isinstance(reply, dict) and reply.get("success") is False:
        raise WeightSyncError(f"{url} refused the update: {reply.get('message')}")
    return reply
