"""Sharded, atomic training checkpoints: Megatron's distributed checkpointing plus Lightning's loop state.

A checkpoint is a folder (Lightning's `*.ckpt` path names it):

    megatron/        every rank's model and optimizer shards (megatron.core.dist_checkpointing, reshardable)
    lightning.pt     Lightning's part: loops, callbacks, LR schedulers, epoch/step, hyperparameters
    rng/rank{N}.pt   each rank's RNG states (Python, NumPy, torch, CUDA, Megatron's model-parallel streams)
    COMPLETE         written last

All ranks write into a hidden staging folder next to the target; only when every rank has finished does rank 0
write `COMPLETE` and rename the folder into place. A run killed mid-write leaves only the staging folder, which
no `*.ckpt` pattern matches and `load` refuses.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

COMPLETE_MARKER = "COMPLETE"
SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}


class CheckpointError(RuntimeError):
    """A checkpoint folder that is missing, incomplete, or not written by MegatronStrategy."""


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def save(path: Path, model_chunks: list[torch.nn.Module], optimizer: Any | None, checkpoint: dict[str, Any]) -> None:
    """Write `checkpoint` (Lightning's dict) and the sharded model/optimizer to `path`; every rank calls it."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    staging = path.parent / f".{path.name}.partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "rng").mkdir(parents=True)
        (staging / "megatron").mkdir()
    dist.barrier()
    sharded = _sharded_state_dict(model_chunks, optimizer, is_loading=False)
    dist_checkpointing.save(sharded, str(staging / "megatron"), content_metadata=SHARDED_METADATA)
    torch.save(_rng_states(), staging / "rng" / f"rank{rank}.pt")
    if rank == 0:
        lightning_part = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        lightning_part["megatron_optimizer_saved"] = optimizer is not None
        torch.save(lightning_part, staging / "lightning.pt")
    dist.barrier()
    if rank == 0:
        (staging / COMPLETE_MARKER).write_text("")
        move_into_place(staging, path)
    dist.barrier()


def load(path: Path, model_chunks: list[torch.nn.Module], optimizer: Any | None) -> dict[str, Any]:
    """Load the model shards (and the optimizer's, when given and saved) in place; returns Lightning's part."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete MegatronStrategy checkpoint (no {COMPLETE_MARKER} file): it is missing, was "
            "interrupted while being written, or was saved by another strategy; pick an earlier checkpoint"
        )
    checkpoint = torch.load(path / "lightning.pt", weights_only=False)
    if not checkpoint.pop("megatron_optimizer_saved"):
        optimizer = None
    sharded = _sharded_state_dict(model_chunks, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(sharded, str(path / "megatron"))
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        unwrap_model(chunk).load_state_dict(loaded[key])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_states(torch.load(rng_file, weights_only=False))
    checkpoint["optimizer_states"] = []
    checkpoint["state_dict"] = {}
    return checkpoint


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _model_keys(model_chunks: list[torch.nn.Module]) -> list[str]:
    return ["model"] if len(model_chunks) == 1 else [f"model{index}" for index in range(len(model_chunks))]


def _sharded_state_dict(model_chunks: list[torch.nn.Module], optimizer: Any | None, *, is_loading: bool) -> dict:
    from megatron.core.utils import unwrap_model

    sharded = {key: unwrap_model(chunk).sharded_state_dict(metadata=SHARDED_METADATA)
               for key, chunk in zip(_model_keys(model_chunks), model_chunks)}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=is_loading, metadata=SHARDED_METADATA)
    return sharded


def _rng_states() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
              "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["megatron"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def move_into_place(staging: Path, path: Path) -> None:
    """Rename the finished staging folder to `path`, replacing an earlier checkpoint of the same name."""
    if path.exists():
        retired = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, retired)
        os.replace(staging, path)
        shutil.rmtree(retired)
    else:
        os.replace(staging, path)
