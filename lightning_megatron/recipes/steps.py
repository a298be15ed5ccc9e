"""The steps recipes are made of: a config derived from one in `configs/`, a `lightning-megatron` run of it in its
own process (exactly what a user runs), and an acceptance measurement by speculative decoding.

`configs/` is package data (`lightning_megatron/configs`, with a `configs` link at the checkout's top for the
documented commands), read through `importlib.resources`: a wheel install finds it as a checkout does."""

from __future__ import annotations

import json
import os
import sys
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TextIO

import yaml

from lightning_megatron.recipes.preloaded import run_module

CONFIGS: Traversable = files("lightning_megatron") / "configs"


def derived_config(source: str, target: Path, overrides: dict[str, Any]) -> Path:
    """A copy of `configs/<source>` with dotted keys replaced (list items by index), written to `target`."""
    config = yaml.safe_load(CONFIGS.joinpath(*source.split("/")).read_text())
    for dotted, value in overrides.items():
        node = config
        *parents, last = dotted.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target


def run_cli(subcommand: str, config: Path, title: str) -> None:
    """`lightning-megatron <subcommand> --config <config>` in its own process (on the CPU a fork of one that
    imported the libraries once: `preloaded.py`), its output in `<config>.log`."""
    print(f"{title}: lightning-megatron {subcommand} --config {config}", flush=True)
    log = config.with_suffix(".log")
    returncode = run_module(["lightning_megatron.cli", subcommand, "--config", str(config)], _subprocess_env(), log)
    if returncode:
        sys.stderr.write(log.read_text()[-5000:])
        raise SystemExit(f"lightning-megatron {subcommand} failed (exit {returncode}); full log: {log}")
    print(f"      log: {log}", flush=True)


def acceptance(checkpoint: Path, prompts: list[str], max_new_tokens: int, out: Path,
               device: str = "cpu", draft_tokens: tuple[int, ...] = (1,), *, batch_size: int = 16,
               progress: TextIO | None = None) -> dict[str, Any]:
    """Speculative decoding with the checkpoint's MTP head vs plain decoding (fp32, `batch_size` prompts at once):
    the report's summary, greedy and sampled at temperature 1 for each of `draft_tokens` (none: greedy with one
    draft only), each figure with its interval over prompts and the per-prompt counts; `progress` gets its
    progress lines."""
    import transformers

    from lightning_megatron.speculative import measure_checkpoint, write_report

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    report = measure_checkpoint(checkpoint, prompts, max_new_tokens=max_new_tokens, device=device,
                                draft_tokens=draft_tokens, batch_size=batch_size, progress=progress)
    write_report(report, out)
    return report["summary"]


def read_jsonl(path: Path | Traversable) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def _subprocess_env() -> dict[str, str]:
    """The CLI processes pick their own rendezvous port; Python warnings from the libraries stay quiet."""
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env
