"""Fast safetensors writing shared by the bridges: shard plans, and shards written by several threads (and ranks).

The safetensors library serialises a whole shard in one call that holds the GIL; here each shard file is written
by its own thread straight from the tensors' memory (a header, then each tensor's bytes, `write` releasing the
GIL), so an 8B model's shards reach the disk in parallel. The files are ordinary safetensors files.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SHARD_BYTES = 4 * 1024**3
WRITER_THREADS = 8
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "U8": torch.uint8,
                      "I8": torch.int8, "BOOL": torch.bool}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def plan_shards(sizes: Mapping[str, int], shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names grouped into shards of at most `shard_bytes` (a bigger tensor gets its own), in name order."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        if shards[-1] and used + sizes[name] > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def shard_file_names(count: int) -> list[str]:
    """HF's file names: one `model.safetensors`, or `model-0000i-of-0000n.safetensors`."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def write_safetensors_file(file: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """One safetensors file from CPU tensors, written without an intermediate serialised copy."""
    # safetensors' own order (widest dtype first, then name) keeps every tensor aligned to its element size
    names = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        tensor = tensors[name]
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(file, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name in names:
            tensor = tensors[name]
            if tensor.numel():
                handle.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def write_shard_files(folder: Path, files: Mapping[str, Mapping[str, torch.Tensor]],
                      threads: int = WRITER_THREADS) -> None:
    """Write `{file name: tensors}` into `folder`, one thread per file (at most `threads` at a time)."""
    if not files:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as pool:
        for future in [pool.submit(write_safetensors_file, folder / name, tensors) for name, tensors in files.items()]:
            future.result()


def write_index(folder: Path, shards: list[list[str]], sizes: Mapping[str, int]) -> None:
    """HF's `model.safetensors.index.json` for a sharded checkpoint (nothing for a single file)."""
    if len(shards) == 1:
        return
    weight_map = {name: file for file, shard in zip(shard_file_names(len(shards)), shards) for name in shard}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_safetensors(folder: Path, tensors: Mapping[str, torch.Tensor], shard_bytes: int = SHARD_BYTES) -> None:
    """One `model.safetensors`, or shards of at most `shard_bytes` with an index, as HF writes them."""
    sizes = {name: tensor.nbytes for name, tensor in tensors.items()}
    shards = plan_shards(sizes, shard_bytes)
    names = shard_file_names(len(shards))
    files = {file: {name: tensors[name] for name in shard} for file, shard in zip(names, shards)}
    write_shard_files(folder, files)
    write_index(folder, shards, sizes)
