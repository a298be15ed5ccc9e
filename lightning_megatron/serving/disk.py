"""Versioned HF checkpoints on disk for an engine to reload, and the requests that tell it to.

Layout under a root folder:

    v00000010/   a complete HF checkpoint (written atomically: filled as a hidden `.v00000010.partial-PID`,
    v00000020/   then renamed; a run killed mid-write leaves only the hidden folder, which nothing reads)
    latest       the name of the newest complete folder, replaced atomically (temp file + rename) only after
                 that folder is in place

Only the trainer deletes old versions (`keep_last`), never the one `latest` names, so an engine reading
`latest` always finds a complete checkpoint; one reading an older version can re-read `latest` on failure. Versions
above `latest` (left by an earlier run that went further, before a resume or a new run into the same root) go too.

A version folder also holds `weight_version.json` (`VERSION_FILE`: the version, the version it is a delta of,
and whatever the trainer measured, e.g. the draft head's acceptance), written inside the folder before it is
renamed into place, so it is never apart from its weights.

A delta version (`write_delta_version`) is as complete as any other, but its unchanged files are hard links to
the previous version's (no byte copied): a full version written for deltas keeps the tensors that change in shard
files of their own (`Bridge.save_hf(separate=...)`), so the next version rewrites only those files and a new
`model.safetensors.index.json`. Both spread those tensors over several files, written at once (one thread each:
writes into one file are serialised by the file system) and freed at once when pruned. Deleting an old version
leaves the linked files of the newer ones intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_megatron.atomic import (
    SPARE_FILE_PREFIX,
    remove_folder_soon,
    write_atomically,
    write_text_atomically,
)
from lightning_megatron.hf_io import (
    TensorSpec,
    checkpoint_tensor_specs,
    plan_parallel_shards,
    shard_file_names,
    shard_writer,
)
from lightning_megatron.serving.protocol import WeightSyncError, get_json, post_json

Engine = Literal["sglang", "vllm"]
_VERSION_FOLDER = re.compile(r"^v(\d{8,})$")
VERSION_FILE = "weight_version.json"
INDEX_FILE = "model.safetensors.index.json"


def version_folder(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def read_latest(root: str | Path) -> Path | None:
    """The folder `latest` names (None before the first version)."""
    pointer = Path(root) / "latest"
    return Path(root) / pointer.read_text().strip() if pointer.is_file() else None


def versions(root: Path) -> dict[int, Path]:
    """The complete version folders under `root`, by version."""
    found = {}
    for folder in root.iterdir() if root.is_dir() else ():
        match = _VERSION_FOLDER.match(folder.name)
        if match and folder.is_dir():
            found[int(match.group(1))] = folder
    return found


def publish_latest(root: Path, folder: Path) -> None:
    """Point `latest` at `folder` (already complete) atomically."""
    # readable by an engine running as another user, like the folders; on the disk before an engine polls it
    write_text_atomically(root / "latest", folder.name + "\n", mode=0o644, fsync=True)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` versions up to the one `latest` names (never that one), and every
    version above it; returns what went (gone from its name on return, its bytes freed on a thread:
    `atomic.remove_folder_soon`).

    A version above `latest` was written by an earlier run that went further than this one (a run resumed from an
    earlier step, or a new run into the same root): `latest` never names it again, and kept it would outlast this
    run's own versions and pose as the newest weights."""
    latest = read_latest(root)
    found = sorted(versions(root).items())
    current = next((version for version, folder in found if folder == latest), None)
    stale = [folder for version, folder in found if current is not None and version > current]
    ordered = [folder for version, folder in found if current is None or version <= current]
    doomed = [folder for folder in ordered[:max(0, len(ordered) - keep_last)] if folder != latest] + stale
    for folder in doomed:  # gone from its name at once, its bytes freed on a thread (a sync need not wait)
        remove_folder_soon(folder)
    return doomed


def remove_partials(root: Path) -> None:
    """Staging folders, replaced versions, pointer files and spare adapter files a killed run left behind (hidden:
    no reader ever looked at them; a version written again, as a resumed run does, retires the old folder under
    `.vNNNNNNNN.old-PID` before deleting it, a pruned one goes under `.vNNNNNNNN.old-PID-N` while a thread deletes
    it, and an adapter-only sync preallocates its next file as `.spare-NAME`: `atomic.preallocate_spare`)."""
    for leftover in [*root.glob(".v*.partial-*"), *root.glob(".v*.old-*")] if root.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in [*root.glob(".latest.*.partial"), *root.glob(f"{SPARE_FILE_PREFIX}*")] if root.is_dir() else ():
        leftover.unlink(missing_ok=True)


def sync_to_disk(save: Callable[[Path], Path], root: Path, version: int, *, keep_last: int, is_leader: bool,
                 engine_url: str | None = None, engine: Engine = "sglang", timeout_s: float = 300.0,
                 adapter: bool = False) -> Path:
    """One disk sync: `save` writes the HF folder of `version` atomically (every rank calls it), then the leader
    points `latest` at it, prunes old versions and tells the engine (to reload the model, or with `adapter`, to
    load the PEFT folder as the LoRA adapter named like the folder, in place of one loaded under that name, and unload
    those of the pruned folders); returns the folder.

    Errors of the leader's part are raised there only; the caller makes every rank agree on them.
    """
    rewritten = version_folder(root, version).is_dir()  # a resumed run writes its versions again
    folder = save(version_folder(root, version))
    if is_leader:
        publish_latest(root, folder)
        pruned = prune(root, keep_last)
        if engine_url is not None and adapter:
            if rewritten:  # the engine may hold the earlier adapter of that name: engines refuse a second (vLLM)
                with contextlib.suppress(WeightSyncError):
                    unload_adapter(engine_url, engine, folder.name, timeout_s)
            load_adapter(engine_url, engine, folder, timeout_s)
            for gone in pruned:  # the engine serves no adapter whose folder is gone (nor holds it for ever)
                with contextlib.suppress(WeightSyncError):  # one it never loaded (an earlier run's, a restart)
                    unload_adapter(engine_url, engine, gone.name, timeout_s)
        elif engine_url is not None:
            notify_engine(engine_url, engine, folder, version, timeout_s)
    return folder


def read_version_record(folder: str | Path) -> dict[str, Any] | None:
    """A version folder's `VERSION_FILE` (None for a folder written without one, e.g. a plain export)."""
    file = Path(folder) / VERSION_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def served_version(source: str | Path) -> dict[str, Any] | None:
    """What a rollout worker reads of the version it serves: the version record (`version`, `base_version` and what
    the trainer measured, e.g. `draft_acceptance`: `lightning_megatron.mtp.DraftAcceptance.from_json` reads it).
    `source`: an engine's URL (its `/model_info`'s `weight_version_metadata`), a disk sync's root (the version
    `latest` names) or a version folder. None where nothing was recorded."""
    if str(source).startswith(("http://", "https://")):
        return get_json(f"{str(source).rstrip('/')}/model_info", 60.0).get("weight_version_metadata")
    folder = Path(source)
    if (folder / "latest").is_file():
        folder = read_latest(folder) or folder
    return read_version_record(folder)


def weight_map(folder: Path) -> dict[str, str]:
    """`{tensor name: file}` of an HF checkpoint folder (its index, or its one `model.safetensors`)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as reader:
        return {name: "model.safetensors" for name in reader.keys()}


def delta_base(root: Path, version: int | None, changed: Collection[str],
               specs: Mapping[str, TensorSpec]) -> Path | None:
    """The folder a delta onto `version` can share files with, or None when a full version must be written: the
    version is gone or is not the one `latest` names (an engine would not hold it), one of its files mixes tensors
    that changed with tensors that did not (its layout was made for another set of changing tensors), or its
    tensors are not `specs` (the model's names, shapes and dtypes now) as their files' headers read, or a file (the
    index included) is missing or unreadable: a delta would link them into the new version as they are (other
    tensors of the folder, e.g. a multimodal checkpoint's vision tower, go along unchecked)."""
    if version is None or read_latest(root) != version_folder(root, version):
        return None
    folder = version_folder(root, version)
    if not (folder / INDEX_FILE).is_file():
        return None
    try:
        files_of = weight_map(folder)
        if not all(isinstance(file, str) for file in files_of.values()):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a damaged index: written in full instead
        return None
    if not set(changed) <= set(files_of):
        return None
    touched = {files_of[name] for name in changed}
    if any(files_of[name] in touched for name in set(files_of) - set(changed)):
        return None
    if not all((folder / file).is_file() for file in set(files_of.values())):
        return None
    try:
        held = checkpoint_tensor_specs(folder)
    except Exception:  # safetensors' own error type, OSError, an unknown dtype: written in full instead
        return None
    return folder if all(held.get(name) == spec for name, spec in specs.items()) else None


def write_delta_version(base: Path, folder: Path, specs: Mapping[str, TensorSpec],
                        tensors: Iterable[tuple[str, torch.Tensor]], extra_files: Mapping[str, str]) -> Path:
    """Write `folder` atomically: the checkpoint `base` with the tensors of `specs` replaced by `tensors` (on the
    host or a GPU, in any order: an export's), see the module docstring.

    The new tensors are spread over several files of about equal bytes (`hf_io.plan_parallel_shards`,
    `model-v00000010-00001-of-00004.safetensors`), each written by its own thread as the tensors arrive, from a GPU
    through pinned staging (`hf_io.shard_writer`): the delta is written as fast as a full version's bytes are."""
    files_of = weight_map(base)
    rewritten = {files_of[name] for name in specs}
    shards = plan_parallel_shards({name: spec.nbytes for name, spec in specs.items()})
    new_files = dict(zip(shard_file_names(len(shards), prefix=f"model-{folder.name}"), shards))

    def write(staging: Path) -> None:
        with shard_writer(staging, {file: [specs[name] for name in shard] for file, shard in new_files.items()}
                          ) as writer:
            for name, tensor in tensors:
                writer.write(name, tensor)
        for file in base.iterdir():
            if file.is_file() and file.name not in rewritten and file.name not in (INDEX_FILE, VERSION_FILE):
                _link_or_copy(file, staging / file.name)
        index = json.loads((base / INDEX_FILE).read_text())
        file_of_new = {name: file for file, shard in new_files.items() for name in shard}
        index["weight_map"] = {name: file_of_new.get(name, file) for name, file in files_of.items()}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for name, text in extra_files.items():
            (staging / name).write_text(text)

    write_atomically(folder, write)
    return folder


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (the bytes are shared); a copy where the file system has none."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def notify_engine(url: str, engine: Engine, folder: Path, version: int, timeout_s: float) -> None:
    """Tell an engine to reload from `folder`: SGLang's `/update_weights_from_disk`, or vLLM's weight-transfer
    round with `update_info {path}` (`/start_weight_update`, `/update_weights`, `/finish_weight_update`)."""
    url = url.rstrip("/")
    path = str(folder.resolve())
    if engine == "sglang":
        post_json(f"{url}/update_weights_from_disk",
                  {"model_path": path, "weight_version": str(version), "flush_cache": True}, timeout_s)
    elif engine == "vllm":
        post_json(f"{url}/start_weight_update", {"is_checkpoint_format": True}, timeout_s)
        post_json(f"{url}/update_weights", {"update_info": {"path": path}}, timeout_s)
        post_json(f"{url}/finish_weight_update", {}, timeout_s)
    else:
        raise ValueError(f"engine: {engine!r} is not one of 'sglang', 'vllm'")


def load_adapter(url: str, engine: Engine, folder: Path, timeout_s: float) -> None:
    """Have an engine load a PEFT folder as a LoRA adapter named like the folder (`v00000010`): SGLang's
    `/load_lora_adapter`, vLLM's `/v1/load_lora_adapter`; rollouts then ask for that adapter by name."""
    route = {"sglang": "load_lora_adapter", "vllm": "v1/load_lora_adapter"}[engine]
    post_json(f"{url.rstrip('/')}/{route}", {"lora_name": folder.name, "lora_path": str(folder.resolve())},
              timeout_s)


def unload_adapter(url: str, engine: Engine, name: str, timeout_s: float) -> None:
    """Have an engine drop the LoRA adapter `name` (SGLang's `/unload_lora_adapter`, vLLM's
    `/v1/unload_lora_adapter`)."""
    route = {"sglang": "unload_lora_adapter", "vllm": "v1/unload_lora_adapter"}[engine]
    post_json(f"{url.rstrip('/')}/{route}", {"lora_name": name}, timeout_s)
