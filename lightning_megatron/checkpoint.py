"""Sharded, atomic training checkpoints: Megatron's distributed checkpointing plus Lightning's loop state.

A checkpoint is a folder (Lightning's `*.ckpt` path names it):

    megatron/        every rank's model and optimizer shards (megatron.core.dist_checkpointing, reshardable)
    lightning.pt     Lightning's part: loops, callbacks, LR schedulers, epoch/step, hyperparameters, and the
                     parallel layout the checkpoint was written with
    rng/rank{N}.pt   each rank's RNG states (Python, NumPy, torch, CUDA, Megatron's model-parallel streams)
    manifest.json    size and CRC-32 of every file above
    COMPLETE         written last

All ranks write into a hidden staging folder next to the target; only when every rank has finished does rank 0
write the manifest and `COMPLETE` and rename the folder into place (`publish`), whether the shards were written
before `save` returned or in the background (`background=True`, see `background_save.py`). A run killed mid-write
leaves only the staging folder, which no `*.ckpt` pattern matches and `load` refuses. A background writer also
describes its own shard files (size and CRC-32, in the staging folder's `.described/rank{N}.json`) once they are
written, so that publishing, which runs on the training thread, does not read the shards again (reading 16 GB
for their CRCs would stall one training step by seconds); `.described` is removed before the manifest is written.

Loading trusts nothing in the folder: pickled files are read through `safe_load` (no code runs, only the types our
saves contain), and before any shard is read every rank checks its share of the files against the manifest, so a
missing, truncated, damaged or extra file fails on every rank at once with its name.
"""

from __future__ import annotations

import functools
import io
import json
import random
import shutil
import zlib
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_megatron.atomic import move_into_place, write_text_atomically
from lightning_megatron.distributed import ParallelSizes, agree_on_failure, megatron_rng_states, set_megatron_rng_states
from lightning_megatron.safe_load import UnsafeFileError, load_dcp_metadata, load_torch_file, weights_only_everywhere

COMPLETE_MARKER = "COMPLETE"
MANIFEST = "manifest.json"
DESCRIBED = ".described"  # in a staging folder only: the shard descriptions background writers computed
SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
# Distributed-optimizer formats Megatron can load under any parallel sizes; the others need the sizes they were
# saved with ("dp_reshardable": the same model-parallel sizes, any data-parallel size).
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
_CRC_CHUNK = 16 * 1024**2
_EXTRA_STATE = "_extra_state"  # torch.nn.Module's key for get_extra_state()


class CheckpointError(RuntimeError):
    """A checkpoint folder that is missing, incomplete, damaged, or not loadable with the current settings."""


def check_optimizer_sharding(optimizer_sharding: str, use_distributed_optimizer: bool) -> None:
    """Reject a `checkpoint_optimizer_sharding` MegatronStrategy cannot write, before anything runs."""
    if optimizer_sharding not in ("fully_reshardable", "dp_reshardable"):
        raise ValueError(f"checkpoint_optimizer_sharding: {optimizer_sharding!r} is not one of 'fully_reshardable', "
                         "'dp_reshardable'")
    if optimizer_sharding != "fully_reshardable" and not use_distributed_optimizer:
        raise ValueError("checkpoint_optimizer_sharding: dp_reshardable is a format of the distributed optimizer; "
                         "set use_distributed_optimizer: true or leave it at fully_reshardable")


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def save(path: Path, model_chunks: list[torch.nn.Module], optimizer: Any | None, checkpoint: dict[str, Any], *,
         optimizer_sharding: str = "fully_reshardable", background: bool = False) -> Any | None:
    """Write `checkpoint` (Lightning's dict) and the sharded model/optimizer to `path`; every rank calls it.

    `optimizer_sharding` is Megatron's `distrib_optim_sharding_type`: "fully_reshardable" loads under any parallel
    sizes; "dp_reshardable" saves without gathering but loads only with the same model-parallel sizes.
    `background`: write the shards through Megatron's asynchronous dist-checkpointing and return its `AsyncRequest`
    (schedule it with `AsyncCallsQueue`, see `background_save.py`); the request's last finalize step publishes the
    folder (manifest, `COMPLETE`, rename), so `path` appears only once every rank's shards are on disk.
    """
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    staging = staging_folder(path)
    error = None
    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / "rng").mkdir(parents=True)
            (staging / "megatron").mkdir()
        except OSError as caught:
            error = CheckpointError(f"saving {path}: cannot create its staging folder {staging} ({caught}); make "
                                    f"{path.parent} writable or save the checkpoints elsewhere (dirpath)")
    agree_on_failure(error, error_type=CheckpointError)
    metadata = {**SHARDED_METADATA, "distrib_optim_sharding_type": optimizer_sharding}
    sharded = _sharded_state_dict(model_chunks, optimizer, metadata, is_loading=False)
    # in the background through megatron-core's own asynchronous writer (its default, nvidia-resiliency-ext's, is no
    # dependency); a synchronous save takes no option of it
    writer = dict(async_sharded_save=True, async_strategy="mcore") if background else {}
    request = dist_checkpointing.save(sharded, str(staging / "megatron"), content_metadata=metadata, **writer)
    torch.save(_rng_states(), staging / "rng" / f"rank{rank}.pt")
    if rank == 0:
        lightning_part = {key: value for key, value in checkpoint.items()
                          if key not in ("state_dict", "optimizer_states")}
        lightning_part["megatron_optimizer_saved"] = optimizer is not None
        sizes = ParallelSizes.current().saved_fields()
        lightning_part["megatron_layout"] = {**sizes, "optimizer_sharding": optimizer_sharding}
        torch.save(lightning_part, staging / "lightning.pt")
    if request is None:
        publish(staging, path)
        return None
    if request.async_fn is not None:
        request = request._replace(async_fn=functools.partial(_write_then_describe, request.async_fn, staging, rank))
    request.add_finalize_fn(lambda: publish(staging, path))
    return request


def model_shard_bytes(model_chunks: list[torch.nn.Module]) -> list[int]:
    """The byte count of every model shard this rank writes in a checkpoint: its main replicas (Megatron writes a
    replicated shard once, from the replica whose `replica_id` is all zeros). No copies are made."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    sharded = _sharded_state_dict(model_chunks, None, SHARDED_METADATA, is_loading=False)
    return [value.data.nbytes for value in nested_values(sharded)
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.Tensor)
            and is_main_replica(value.replica_id)]


def _write_then_describe(write: Any, staging: Path, rank: int, *args: Any, **kwargs: Any) -> None:
    """A background writer's work (`write`), then the size and CRC-32 of the shard files it wrote (Megatron's
    `__{rank}_*.distcp`), for `publish`."""
    write(*args, **kwargs)
    shards = sorted((staging / "megatron").glob(f"__{rank}_*.distcp"))
    described = {shard.relative_to(staging).as_posix(): _describe(shard) for shard in shards}
    (staging / DESCRIBED).mkdir(exist_ok=True)
    write_text_atomically(staging / DESCRIBED / f"rank{rank}.json", json.dumps(described))


def _described_by_writers(staging: Path) -> dict[str, dict[str, int]]:
    folder = staging / DESCRIBED
    return {name: entry for file in sorted(folder.glob("rank*.json"))
            for name, entry in json.loads(file.read_text()).items()} if folder.is_dir() else {}


def staging_folder(path: Path) -> Path:
    """Where a checkpoint for `path` is written before it is published: hidden, so no `*.ckpt` pattern picks it."""
    return path.parent / f".{path.name}.partial"


def publish(staging: Path, path: Path) -> None:
    """Once every rank's files are in `staging`: the manifest, then `COMPLETE`, then the rename to `path`."""
    dist.barrier()
    by_writers = _described_by_writers(staging)
    files = _share([name for name in _written_files(staging) if name not in by_writers])
    described = {name: _describe(staging / name) for name in files}
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, described)
    error = None
    if dist.get_rank() == 0:
        manifest = {**by_writers, **{name: entry for share in shares for name, entry in share.items()}}
        try:
            shutil.rmtree(staging / DESCRIBED, ignore_errors=True)
            (staging / MANIFEST).write_text(json.dumps({"files": dict(sorted(manifest.items()))}, indent=1) + "\n")
            (staging / COMPLETE_MARKER).write_text("")
            move_into_place(staging, path)
        except OSError as caught:
            error = CheckpointError(f"saving {path}: publishing {staging} failed ({caught}); nothing was written at "
                                    f"{path}; free space or fix the permissions of {path.parent}")
    agree_on_failure(error, error_type=CheckpointError)


def load(path: Path, model_chunks: list[torch.nn.Module], optimizer: Any | None) -> dict[str, Any]:
    """Load the model shards (and the optimizer's, when given and saved) in place; returns Lightning's part."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model
    from torch.distributed.checkpoint.api import CheckpointException

    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete MegatronStrategy checkpoint (no {COMPLETE_MARKER} file): it is missing, was "
            "interrupted while being written, or was saved by another strategy; pick an earlier checkpoint"
        )
    checkpoint, rng_states, dcp_metadata = _read_and_verify(path)
    saved_sizes = checkpoint.pop("megatron_layout", None) or {}
    if not checkpoint.pop("megatron_optimizer_saved"):
        optimizer = None
    sharding = saved_sizes.get("optimizer_sharding", "fully_reshardable")
    if optimizer is not None:
        _check_parallel_sizes(path, saved_sizes, sharding)
    metadata = {**SHARDED_METADATA, "distrib_optim_sharding_type": sharding}
    sharded = _sharded_state_dict(model_chunks, optimizer, metadata, is_loading=True)
    with weights_only_everywhere():
        try:
            loaded = dist_checkpointing.load(sharded, str(path / "megatron"))
        except (Exception, CheckpointException) as error:  # torch's CheckpointException is a BaseException
            raise _unreadable_shard(path / "megatron", dcp_metadata) or error
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        _load_model_state(unwrap_model(chunk), loaded[key])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if rng_states is not None:
        _set_rng_states(rng_states)
    checkpoint["optimizer_states"] = []
    checkpoint["state_dict"] = {}
    return checkpoint


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- checks


def _read_and_verify(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None, Any]:
    """Lightning's part, this rank's RNG states and Megatron's metadata, read safely, once every rank has checked
    its share of the files against the manifest. Any problem raises on every rank, the most telling one first."""
    problems: list[tuple[int, str, str]] = []  # (priority, error class, message)
    loaded: dict[str, Any] = {}
    rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
    for key, reader, file in (("lightning", load_torch_file, path / "lightning.pt"),
                              ("rng", load_torch_file, rng_file),
                              ("metadata", load_dcp_metadata, path / "megatron" / ".metadata")):
        if key == "rng" and not file.is_file():
            continue
        try:
            loaded[key] = reader(file)
        except UnsafeFileError as error:
            problems.append((0, "unsafe", str(error)))
        except Exception as error:  # damaged: the manifest check below names how, when the checkpoint has one
            problems.append((2, "damaged", f"{file} cannot be read ({type(error).__name__}: {error}); "
                                           "copy the checkpoint again or pick an earlier one"))
    problems += [(1, "damaged", message) for message in _check_manifest_share(path)]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = sorted(problem for rank_problems in everyone for problem in rank_problems)
    if found:
        _, kind, message = found[0]
        raise (UnsafeFileError if kind == "unsafe" else CheckpointError)(message)
    return loaded["lightning"], loaded.get("rng"), loaded["metadata"]


def _check_manifest_share(path: Path) -> list[str]:
    """This rank's share of the manifest check: files missing, extra (not written by us), truncated, or changed."""
    if not (path / MANIFEST).is_file():
        return []  # written before manifests existed: no integrity check
    try:
        expected = json.loads((path / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError) as error:
        return [f"{path / MANIFEST} cannot be read ({error}); copy the checkpoint again or pick an earlier one"]
    advice = "copy the checkpoint folder again from where it was written, or resume from an earlier checkpoint"
    problems = []
    read_by_loading = [name for name in _written_files(path) if name.startswith(("megatron/", "rng/"))]
    for name in _share(sorted(set(read_by_loading) - set(expected))):
        problems.append(f"{path / name} was not written by MegatronStrategy (it is not in {MANIFEST}); refusing to "
                        "load a checkpoint folder with files Megatron might read that we did not write: remove it")
    for name in _share(sorted(expected)):
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing (listed in {MANIFEST}): the checkpoint is incomplete; {advice}")
            continue
        actual = _describe(file)
        if actual["size"] != expected[name]["size"]:
            problems.append(f"{file} is {actual['size']} bytes, but {expected[name]['size']} were written: it is "
                            f"truncated or damaged; {advice}")
        elif actual["crc32"] != expected[name]["crc32"]:
            problems.append(f"{file} differs from the file that was written (CRC-32 mismatch): it is damaged or "
                            f"was modified; {advice}")
    return problems


def _check_parallel_sizes(path: Path, saved: dict[str, Any], sharding: str) -> None:
    """A distributed-optimizer state that is not fully reshardable loads only with the sizes it was saved with."""
    if sharding in FULLY_RESHARDABLE or not saved:
        return
    current = ParallelSizes.current().saved_fields()
    must_match = [key for key in current if key != "data_parallel_size" or sharding != "dp_reshardable"]
    differing = [key for key in must_match if saved.get(key) != current[key]]
    if differing:
        sizes = ", ".join(f"{key}: saved {saved.get(key)}, now {current[key]}" for key in differing)
        raise CheckpointError(
            f"{path}: its optimizer state was saved as {sharding!r}, which loads only with the parallel sizes it "
            f"was saved with ({sizes}). Resume with the saved sizes, or load the weights only (trainer.validate / "
            "trainer.predict with ckpt_path, or a fresh fit from an HF export); checkpoints saved with "
            "checkpoint_optimizer_sharding: fully_reshardable (the default) load under any sizes"
        )


def _unreadable_shard(folder: Path, dcp_metadata: Any) -> Exception | None:
    """After Megatron's load failed: the first stored object that cannot be read safely, named by file and key."""
    for index, info in sorted(dcp_metadata.storage_data.items(), key=lambda item: item[1].relative_path):
        file = folder / info.relative_path
        try:
            with open(file, "rb") as stream:
                stream.seek(info.offset)
                data = stream.read(info.length)
            if len(data) != info.length:
                raise EOFError(f"read {len(data)} of its {info.length} bytes")
            load_torch_file(io.BytesIO(data), f"{file} ({index.fqn})")
        except UnsafeFileError as error:
            return error
        except Exception as error:
            return CheckpointError(f"{file}: {index.fqn} cannot be read ({type(error).__name__}: {error}): the file "
                                   "is damaged; copy the checkpoint again or pick an earlier one")
    return None


# ---------------------------------------------------------------------------------------------------- helpers


def _written_files(folder: Path) -> list[str]:
    """What a checkpoint folder holds besides its markers, as sorted relative paths."""
    return sorted(file.relative_to(folder).as_posix() for file in folder.rglob("*")
                  if file.is_file() and file.name not in (COMPLETE_MARKER, MANIFEST)
                  and file.relative_to(folder).parts[0] != DESCRIBED)


def _share(items: list[str]) -> list[str]:
    """This rank's share of `items` (every rank gets the same list)."""
    return items[dist.get_rank()::dist.get_world_size()]


def _describe(file: Path) -> dict[str, int]:
    crc = 0
    with open(file, "rb") as stream:
        while chunk := stream.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": file.stat().st_size, "crc32": crc}


def _model_keys(model_chunks: list[torch.nn.Module]) -> list[str]:
    return ["model"] if len(model_chunks) == 1 else [f"model{index}" for index in range(len(model_chunks))]


def _load_model_state(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """`module.load_state_dict(state)` for a `state` keyed the way `module.state_dict()` names things.

    Megatron's sharded state dict, and so every checkpoint, uses `state_dict()`'s names, and a module may name its
    children differently there than in its module tree: megatron-bridge's LoRA wrapper (a pre-wrap hook's
    `AdapterWrapper`) saves its wrapped linear's `to_wrap.weight` as `weight`, while `load_state_dict` wants the
    module path. Each such key is loaded under the module path of the tensor `state_dict()` returns for it, so the
    model loads into the structure it saved from, whatever a pre-wrap hook did to it; strict, as before.
    """
    paths = _module_paths(module)
    module.load_state_dict({paths.get(name, name): value for name, value in state.items()})


def _module_paths(module: torch.nn.Module) -> dict[str, str]:
    """`state_dict()` name -> `load_state_dict` name, for the names that differ; an extra state follows its
    module's renamed tensors."""
    paths: dict[int, list[str]] = {}
    for path, tensor in chain(module.named_parameters(remove_duplicate=False),
                              module.named_buffers(remove_duplicate=False)):
        paths.setdefault(id(tensor), []).append(path)
    saved = module.state_dict(keep_vars=True)
    renamed = {}
    for name, value in saved.items():
        candidates = paths.get(id(value), []) if isinstance(value, torch.Tensor) else []
        if candidates and name not in candidates:
            renamed[name] = candidates[0]
    owners = {name.rpartition(".")[0]: path.rpartition(".")[0] for name, path in renamed.items()}
    for name in saved:
        owner, _, leaf = name.rpartition(".")
        if leaf == _EXTRA_STATE and owner in owners:
            renamed[name] = f"{owners[owner]}.{_EXTRA_STATE}"
    return renamed


def _sharded_state_dict(model_chunks: list[torch.nn.Module], optimizer: Any | None, metadata: dict[str, Any], *,
                        is_loading: bool) -> dict:
    from megatron.core.utils import unwrap_model

    sharded = {key: unwrap_model(chunk).sharded_state_dict(metadata=metadata)
               for key, chunk in zip(_model_keys(model_chunks), model_chunks)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=is_loading, metadata=metadata)
    return sharded


def _rng_states() -> dict[str, Any]:
    """Every RNG state as tensors and plain values, so that loading needs no type beyond torch's weights_only set;
    Megatron's streams as tensors whichever tracker holds them (`megatron_rng_states`), so a checkpoint resumes
    under any `cuda_graph`."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    states = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(),
              "megatron": megatron_rng_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    """Put back what `_rng_states` took; `states` is left as it was (it may be set again, as a retried load does)."""
    numpy_state = {**states["numpy"], "state": {**states["numpy"]["state"]}}
    numpy_state["state"]["key"] = numpy_state["state"]["key"].numpy().astype(np.uint32)
    random.setstate(states["python"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(states["torch"])
    set_megatron_rng_states(states["megatron"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])

