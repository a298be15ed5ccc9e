"""Reading pickled files from a checkpoint folder without letting the folder run code.

A pickle can name any importable callable and have it called while loading (`__reduce__`), so a checkpoint folder
from someone else could run code on the machine that loads it. Every pickled file this project reads therefore
goes through this module, which admits only the types our own saves contain. The allowlists, in one place:

- `torch.load` files (`lightning.pt`, `rng/rank*.pt`, and the objects inside Megatron's `*.distcp` shards:
  per-layer `_extra_state`, the `common_state` holding the optimizer's param groups, saved without the optimizer
  classes the offloaded optimizer keeps there, see `optimizer.without_optimizer_classes`): `weights_only=True`, i.e.
  torch's own allowlist (tensors, storages, dtypes, `torch.Size`, `OrderedDict`, and plain containers of
  str/int/float/bool/None), plus `TORCH_LOAD_ALLOWLIST` below, which is empty: our saves need nothing more. The
  RNG states are written as tensors and plain Python values for that reason (NumPy's state would need NumPy's
  array reconstructor). A project that puts its own types into hyperparameters or callback state registers them
  with `torch.serialization.add_safe_globals([...])`, torch's public way to widen the allowlist.
- Megatron's `.metadata` (torch.distributed.checkpoint unpickles it with plain `pickle.load`): read first by
  `load_dcp_metadata`, which admits only `DCP_METADATA_ALLOWLIST`: the dataclasses and enums
  torch.distributed.checkpoint writes there, `torch.Size`, torch dtypes and torch's layout lookup.
- While Megatron's loader runs, `weights_only_everywhere` sets torch's documented `TORCH_FORCE_WEIGHTS_ONLY_LOAD`,
  so the `torch.load(..., weights_only=False)` calls inside torch.distributed.checkpoint load with the allowlist.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

# Types admitted in `torch.load` files beyond torch's weights_only defaults: none (see the module docstring).
TORCH_LOAD_ALLOWLIST: list[Any] = []

_DCP = "torch.distributed.checkpoint"
# (module, name) pairs `.metadata` may name; torch dtypes (`torch.float32`, ...) are admitted by type.
DCP_METADATA_ALLOWLIST = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by its name ("torch.strided")
    ("collections", "OrderedDict"),
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
})
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class UnsafeFileError(RuntimeError):
    """A file that holds something other than the types our saves contain; it was not loaded."""


def _refusal(path: Path | str, found: str) -> UnsafeFileError:
    """The error for a refused file: what it holds, why it was not loaded, and what to do."""
    return UnsafeFileError(
        f"{path}: refused to load: it holds {found}, which is not among the types a lightning-megatron checkpoint "
        "contains (see lightning_megatron/safe_load.py). Unpickling it could run code from the file. Load only "
        "checkpoints you or a trusted source wrote; if you wrote it with your own types in hyperparameters or "
        "callback state, register them with torch.serialization.add_safe_globals([...])"
    )


def load_torch_file(source: Path | IO[bytes], name: str | None = None) -> Any:
    """`torch.load(source, weights_only=True)` with our allowlist; refuses a file naming other types, by name.

    A file that fails for another reason (truncated, damaged) raises torch's own error, for the caller to report.
    """
    try:
        with torch.serialization.safe_globals(TORCH_LOAD_ALLOWLIST):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        unsafe = _unsafe_globals(source)
        if unsafe:
            raise _refusal(name or source, unsafe) from None
        raise


def _unsafe_globals(source: Path | IO[bytes]) -> str:
    """The globals a torch.save file names outside the allowlist, found without running its pickle."""
    if not isinstance(source, Path):
        source.seek(0)
    try:
        with torch.serialization.safe_globals(TORCH_LOAD_ALLOWLIST):
            return ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # not a torch.save file at all: the caller's message stands
        return ""


class _DisallowedGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_ALLOWLIST:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _DisallowedGlobal(f"{module}.{name}")


def load_dcp_metadata(path: Path) -> Any:
    """torch.distributed.checkpoint's `.metadata`, unpickled with `DCP_METADATA_ALLOWLIST` only."""
    try:
        with open(path, "rb") as file:
            return _MetadataUnpickler(file).load()
    except _DisallowedGlobal as error:
        raise _refusal(path, str(error)) from None


@contextmanager
def weights_only_everywhere() -> Iterator[None]:
    """Every `torch.load` in this process loads weights-only with our allowlist until the block ends, including
    calls that pass `weights_only=False` (torch's `TORCH_FORCE_WEIGHTS_ONLY_LOAD`)."""
    previous = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(TORCH_LOAD_ALLOWLIST):
            yield
    finally:
        if previous is None:
            del os.environ[_FORCE_WEIGHTS_ONLY]
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = previous
