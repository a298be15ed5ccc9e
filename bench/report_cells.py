"""The cells of `report.py`'s tables: a result and its kind, figures formatted (seconds, tokens, percents, GiB,
ratios; "n/a" where a run has none) and a markdown row; shared by `report.py` and `report_kernels.py`."""

from __future__ import annotations

from typing import Any

Result = tuple[str, dict[str, Any]]


def kind(data: dict[str, Any]) -> str | None:
    if "benchmark" in data:
        return data["benchmark"]
    return "attention" if "hf_transformers_sdpa" in data else None


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def tokens(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1000:.1f}k"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} GiB"


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
