"""Versioned HF checkpoints on disk for an engine to reload, and the requests that tell it to.

Layout under a root folder:

    v00000010/   a complete HF checkpoint (written atomically: filled as a hidden `.v00000010.partial-PID`,
    v00000020/   then renamed; a run killed mid-write leaves only the hidden folder, which nothing reads)
    latest       the name of the newest complete folder, replaced atomically (temp file + rename) only after
                 that folder is in place

Only the trainer deletes old versions (`keep_last`), never the one `latest` names, so an engine reading
`latest` always finds a complete checkpoint; one reading an older version can re-read `latest` on failure.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from lightning_megatron.atomic import remove_folder, write_text_atomically
from lightning_megatron.serving.protocol import post_json

Engine = Literal["sglang", "vllm"]
_VERSION_FOLDER = re.compile(r"^v(\d{8,})$")


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
    """Delete all but the newest `keep_last` versions (never the one `latest` names); returns what went."""
    latest = read_latest(root)
    ordered = [folder for _, folder in sorted(versions(root).items())]
    doomed = [folder for folder in ordered[:max(0, len(ordered) - keep_last)] if folder != latest]
    for folder in doomed:
        remove_folder(folder, ignore_errors=True)
    return doomed


def remove_partials(root: Path) -> None:
    """Staging folders and pointer files a killed run left behind (hidden: no reader ever looked at them)."""
    for leftover in root.glob(".v*.partial-*") if root.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".latest.*.partial") if root.is_dir() else ():
        leftover.unlink(missing_ok=True)


def sync_to_disk(save: Callable[[Path], Path], root: Path, version: int, *, keep_last: int, is_leader: bool,
                 engine_url: str | None = None, engine: Engine = "sglang", timeout_s: float = 300.0) -> Path:
    """One disk sync: `save` writes the HF folder of `version` atomically (every rank calls it), then the leader
    points `latest` at it, prunes old versions and tells the engine; returns the folder.

    Errors of the leader's part are raised there only; the caller makes every rank agree on them.
    """
    folder = save(version_folder(root, version))
    if is_leader:
        publish_latest(root, folder)
        prune(root, keep_last)
        if engine_url is not None:
            notify_engine(engine_url, engine, folder, version, timeout_s)
    return folder


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
