"""Markdown tables from the benchmarks' JSON, for the README: `python -m bench.report [FILES OR FOLDERS]`.

Reads `bench/results/*.json` by default. Knows the JSON of `lightning_overhead.py` (P1, P2), `mtp_memory.py` (P2
per model shape, against the plain Megatron-Core MTP-only loop), `trunk_cache.py`, `families.py` (the same per
family, and its gated DeltaNet layer comparison), `gdn.py`, `hf_io.py` (P3), `attention.py` (P4, and the older
attention results without MFU), `packing.py` (P5), `tree.py` (P6), `weight_sync.py` (P7) and `async_save.py`; other
JSON files are skipped with a note. Prints a training-step table, a table of the ratios
against their targets, an HF load/save table, the packing layouts and the source of every figure (command,
device, versions, date).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"

Result = tuple[str, dict[str, Any]]


def load(paths: list[Path]) -> list[Result]:
    """`(file name, parsed JSON)` for every JSON file given or inside a folder given, in name order."""
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.glob("*.json")) if path.is_dir() else [path])
    return [(file.name, json.loads(file.read_text())) for file in files]


def kind(data: dict[str, Any]) -> str | None:
    if "benchmark" in data:
        return data["benchmark"]
    return "attention" if "hf_transformers_sdpa" in data else None


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def _tokens(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1000:.1f}k"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} GiB"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _step_row(label: str, figures: dict[str, Any] | None, ratio: str, source: str) -> str | None:
    if figures is None:
        return None
    return _row([label, _seconds(figures.get("step_s")), _tokens(figures.get("tokens_per_s")),
                 _percent(figures.get("mfu")), _gib(figures.get("peak_memory_gib")), ratio, source])


def training_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    rows: list[str | None] = []
    joint_step_by_device: dict[str, float] = {}  # our joint step, to set plain HF's beside on the same device
    for name, data in results:
        if kind(data) != "lightning_overhead":
            continue
        source, runs = f"[{sources[name]}]", data["runs"]
        overhead, mtp_only = data.get("overhead", {}), data.get("mtp_only", {})
        if "lightning" in runs:
            joint_step_by_device[data.get("device", "")] = runs["lightning"]["step_s"]
        precision = "" if data["settings"]["precision"] == "bf16" else f" ({data['settings']['precision']})"
        rows += [
            _step_row(f"plain Megatron-Core loop, joint with MTP{precision}", runs.get("plain"), "reference",
                      source),
            _step_row(f"lightning_megatron, joint with MTP{precision}", runs.get("lightning"),
                      f"{_times(overhead.get('lightning_over_plain_step_time'))} plain step time", source),
            _step_row(f"lightning_megatron, MTP-only (`MTPOnlyCallback`){precision}", runs.get("mtp_only"),
                      f"{_times(mtp_only.get('step_time_ratio'))} joint step time, "
                      f"{_times(mtp_only.get('peak_memory_ratio'))} joint peak memory"
                      + (f" ({_times(mtp_only['peak_memory_ratio_including_setup'])} with set-up)"
                         if mtp_only.get("peak_memory_ratio_including_setup") else ""), source),
        ]
    for name, data in results:
        if kind(data) in MTP_MEMORY_KINDS:
            rows += _mtp_memory_rows(data, f"[{sources[name]}]")
    for name, data in results:
        if kind(data) != "attention":
            continue
        source, megatron = f"[{sources[name]}]", data.get("megatron", {})
        hf = data.get("hf_transformers_sdpa")
        joint_step = joint_step_by_device.get(data.get("device", ""))
        vs_ours = (f"ours (joint, with MTP): {_times(joint_step / hf['step_s'])} its step time"
                   if hf and joint_step else "")
        bf16 = data.get("shape", {}).get("dtype", "bf16") == "bf16"
        rows += [
            _step_row("Megatron-Core, no MTP, SDPA core attention", megatron.get("sdpa"), "", source),
            _step_row("Megatron-Core, no MTP, local core attention", megatron.get("local"), "", source),
            _step_row("plain HF transformers Qwen3, no MTP, SDPA, fused AdamW, "
                      + ("fp32 master + bf16 autocast" if bf16 else "fp32"), hf, vs_ours, source),
        ]
    present = [row for row in rows if row is not None]
    if not present:
        return []
    return ["| run | median step | tokens/s | MFU | peak GPU memory | ratio | source |",
            "|---|---|---|---|---|---|---|", *present]


_MTP_MEMORY_VARIANTS = {"joint": "lightning_megatron, joint with MTP",
                        "mtp_only": "lightning_megatron, MTP-only (`MTPOnlyCallback`)",
                        "mtp_only_eager": "lightning_megatron, MTP-only, trunk eager (no CUDA graph)",
                        "mtp_only_lm_loss_every_step": "lightning_megatron, MTP-only, main head in every step",
                        "plain_mtp_only": "plain Megatron-Core MTP-only loop (non-MTP frozen)",
                        "first_epoch": "MTP-only with the trunk cache, first epoch (writes it)",
                        "cached_epochs": "MTP-only with the trunk cache, later epochs (read it)"}
MTP_MEMORY_KINDS = ("mtp_memory", "trunk_cache", "families")  # JSON with `shapes` of runs, figures and targets
_MTP_MEMORY_FIGURES = {  # figure -> (label, formatter, unit after the target)
    "mtp_only_over_joint_peak_memory": ("MTP-only / joint peak memory", _times, "x"),
    "mtp_only_over_joint_step_time": ("MTP-only / joint step time", _times, "x"),
    "mtp_only_peak_memory_gib": ("MTP-only peak memory", _gib, " GiB"),
    "mtp_only_step_s": ("MTP-only step time", _seconds, " s"),
    "mtp_only_over_plain_mtp_only_step_time": ("MTP-only / plain MTP-only loop step time", _times, "x"),
    "mtp_only_over_plain_mtp_only_peak_memory": ("MTP-only / plain MTP-only loop peak memory", _times, "x"),
}


def _shape_label(shape_name: str, shape: dict[str, Any]) -> str:
    return shape.get("label") or shape_name.replace("qwen3_", "Qwen3-").replace("b", "B")


def _mtp_memory_rows(data: dict[str, Any], source: str) -> list[str | None]:
    rows: list[str | None] = []
    for shape_name, shape in data["shapes"].items():
        if "runs" not in shape:  # a families cut that did not fit, or a part that failed
            why = shape.get("skipped") or "failed: " + shape.get("error", "no runs").strip().splitlines()[-1][:100]
            rows.append(_row([_shape_label(shape_name, shape), why, "", "", "", "", source]))
            continue
        figures = shape.get("figures", {})
        ratios = {
            "joint": "reference",
            "mtp_only": ", ".join(text for text in (
                f"{_times(figures['mtp_only_over_joint_step_time'])} joint step time, "
                f"{_times(figures['mtp_only_over_joint_peak_memory'])} joint peak memory"
                if figures.get("mtp_only_over_joint_step_time") is not None else "",
                f"{_times(figures['mtp_only_over_plain_mtp_only_step_time'])} plain loop's step time, "
                f"{_times(figures.get('mtp_only_over_plain_mtp_only_peak_memory'))} plain loop's peak memory"
                if figures.get("mtp_only_over_plain_mtp_only_step_time") is not None else "") if text),
            "plain_mtp_only": "reference",
        }
        for variant, figures_of_run in shape["runs"].items():
            label = f"{_shape_label(shape_name, shape)}: {_MTP_MEMORY_VARIANTS.get(variant, variant)}"
            rows.append(_step_row(label, figures_of_run, ratios.get(variant, ""), source))
    return rows


def _mtp_memory_target_rows(data: dict[str, Any], source: str) -> list[str]:
    rows = []
    prefix = "issue 40" if kind(data) == "families" else "P2"
    for shape_name, shape in data["shapes"].items():
        for figure, target in shape.get("targets", {}).items():
            label, formatter, unit = _MTP_MEMORY_FIGURES.get(figure, (figure, _times, ""))
            value = shape.get("figures", {}).get(figure)
            met = "n/a" if value is None else ("yes" if value <= target else "no")
            rows.append(_row([f"{prefix} {_shape_label(shape_name, shape)} {label}", formatter(value),
                              f"<= {target}{unit}", met, source]))
    return rows


def gdn_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    """The gated DeltaNet layer alone, fla's kernels against the PyTorch path (`gdn.py`, and `families.py`'s)."""
    rows = []
    for name, data in results:
        gdn = data if kind(data) == "gdn" else data.get("gdn") if kind(data) == "families" else None
        if not gdn:
            continue
        if "pytorch" not in gdn:
            rows.append(_row(["failed: " + gdn.get("error", "").strip().splitlines()[-1][:100], *[""] * 6,
                              f"[{sources[name]}]"]))
            continue
        layer, fla = gdn["layer"], gdn["fla"]
        shape = (f"hidden {layer['hidden']}, {layer['key_heads']}/{layer['value_heads']} key/value heads of "
                 f"{layer['value_head_dim']}; {gdn['micro_batch']} x {gdn['seq']} tokens, {gdn['dtype']}")
        differences = gdn.get("difference", {})
        cells = [f"{values['max_abs']:.2e} of {values['pytorch_max_abs']:.2e}" for values in differences.values()]
        rows.append(_row([shape, _seconds(gdn["pytorch"]["forward_backward_s"]),
                          _seconds(fla["forward_backward_s"]) if "forward_backward_s" in fla
                          else f"skipped: {fla.get('skipped', '')}", _times(gdn.get("pytorch_over_fla")),
                          *(cells or ["n/a"] * 3), f"[{sources[name]}]"]))
    if not rows:
        return []
    return ["| gated DeltaNet layer | PyTorch path fwd+bwd | fla fwd+bwd | PyTorch / fla | output: max abs diff of max "
            "| input grad | in_proj weight grad | source |", "|---|---|---|---|---|---|---|---|", *rows]


def _target_row(figure: str, value: float | None, target: float, source: str) -> str:
    met = "n/a" if value is None else ("yes" if value <= target else "no")
    return _row([figure, _times(value), f"<= {target}x", met, source])


def _at_least_row(figure: str, value: float | None, target: float, formatter: Any, source: str) -> str:
    met = "n/a" if value is None else ("yes" if value >= target else "no")
    return _row([figure, formatter(value), f">= {formatter(target)}", met, source])


def _packing_target_rows(data: dict[str, Any], source: str) -> list[str]:
    """P5: packed rows against full and padded rows, eager and through `cuda_graph="full_iteration"`."""
    summary = data["summary"]
    full_over_padded = summary["target_packed_over_padded"]
    busy = summary.get("gpu_busy_fraction", {})
    speed = {name: figures.get("real_tokens_per_s") for name, figures in data["layouts"].items()}
    candidates = [
        ("P5 packed / full rows, real tokens/s (eager)", summary.get("packed_over_full_tokens_per_s"),
         summary["target_packed_over_full"], _times),
        ("P5 packed / padded rows, real tokens/s (eager)", summary.get("packed_over_padded_tokens_per_s"),
         full_over_padded, _times),
        ("P5 packed (graphed) / the faster full rows, real tokens/s",
         summary.get("packed_graph_over_fastest_full_tokens_per_s"), summary["target_packed_over_full"], _times),
        ("P5 packed (graphed) / padded rows, real tokens/s", summary.get("packed_graph_over_padded_tokens_per_s"),
         full_over_padded, _times),
        ("P5 full rows (graphed), tokens/s", speed.get("full_graph"), summary["target_full_tokens_per_s"], _tokens),
        ("P5 full rows (graphed), GPU busy", busy.get("full_graph"), summary["target_full_gpu_busy_fraction"],
         _percent),
    ]
    return [_at_least_row(figure, value, target, formatter, source)
            for figure, value, target, formatter in candidates if value is not None]


def packing_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    """P5 per layout: step, real tokens/s against eager full rows, GPU-busy fraction, launches, peak memory."""
    rows = []
    for name, data in results:
        if kind(data) != "P5 packing":
            continue
        layouts = data["layouts"]
        full = (layouts.get("full") or {}).get("real_tokens_per_s")
        for layout, figures in layouts.items():
            if "error" in figures:
                rows.append(_row([f"`{layout}`", figures["error"].splitlines()[0][:100], *[""] * 6,
                                  f"[{sources[name]}]"]))
                continue
            speed = figures["real_tokens_per_s"]
            rows.append(_row([f"`{layout}`", _seconds(figures["step_s"]), _tokens(speed),
                              _times(speed / full) if full else "n/a", _percent(figures.get("gpu_busy_fraction")),
                              str(figures.get("kernel_launch_calls", "n/a")),
                              str(figures.get("graph_launch_calls", "n/a")), _gib(figures.get("peak_memory_gib")),
                              f"[{sources[name]}]"]))
    if not rows:
        return []
    return ["| layout | step | real tokens/s | over eager full rows | GPU busy | kernel launches | graph launches | "
            "peak GPU memory | source |", "|---|---|---|---|---|---|---|---|---|", *rows]


def targets_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    rows = []
    for name, data in results:
        source = f"[{sources[name]}]"
        if kind(data) == "P5 packing":
            rows += _packing_target_rows(data, source)
        if kind(data) == "lightning_overhead":
            if "overhead" in data:
                overhead = data["overhead"]
                rows.append(_target_row("P1 Lightning / plain Megatron-Core step time",
                                        overhead["lightning_over_plain_step_time"], overhead["target"], source))
            if "mtp_only" in data:
                mtp_only = data["mtp_only"]
                rows.append(_target_row("P2 MTP-only / joint step time", mtp_only["step_time_ratio"],
                                        mtp_only["targets"]["step_time_ratio"], source))
                rows.append(_target_row("P2 MTP-only / joint peak memory", mtp_only["peak_memory_ratio"],
                                        mtp_only["targets"]["peak_memory_ratio"], source))
        if kind(data) in MTP_MEMORY_KINDS:
            rows += _mtp_memory_target_rows(data, source)
        if kind(data) == "hf_io":
            target = data.get("target_vs_raw", 1.5)
            for bridge, timings in data["bridges"].items():
                rows.append(_target_row(f"P3 {bridge} load / raw read", timings["load_vs_raw_read"], target, source))
                rows.append(_target_row(f"P3 {bridge} save / raw write", timings["save_vs_raw_write"],
                                        data.get("target_save_vs_raw", target), source))
        if kind(data) == "weight_sync":
            sync, targets = data["sync"], data["targets"]
            rows.append(_target_row("P7 disk sync / raw write", sync["disk_sync_vs_raw_write"],
                                    targets["disk_sync_vs_raw_write"], source))
            rows.append(_target_row("P7 colocated sync / disk round trip", sync["colocated_vs_disk_round_trip"],
                                    targets["colocated_vs_disk_round_trip"], source))
            met = "yes" if sync["colocated_sync_s"] <= targets["colocated_sync_s"] else "no"
            rows.append(_row(["P7 colocated sync of the whole model", _seconds(sync["colocated_sync_s"]),
                              f"<= {targets['colocated_sync_s']} s", met, source]))
            if sync["colocated_extra_sender_memory_bytes"] is not None:
                extra = sync["colocated_extra_sender_memory_bytes"] / 2**30
                rows.append(_row(["P7 extra sender GPU memory", f"{extra:.2f} GiB",
                                  f"<= {sync['colocated_extra_memory_limit_bytes'] / 2**30:.2f} GiB",
                                  "yes" if sync["colocated_extra_memory_within_limit"] else "no", source]))
            rows.append(_target_row("P7 step time with WeightSync / without",
                                    data["steps_between_syncs"]["step_time_ratio"], targets["step_time_ratio"], source))
            for figure, label in (("delta_vs_full_disk", "P7 MTP-only delta / full sync, disk"),
                                  ("delta_vs_full_colocated", "P7 MTP-only delta / full sync, colocated"),
                                  ("lora_adapter_vs_full_disk", "P7 LoRA adapter-only / full sync, disk")):
                if "delta" in data:
                    rows.append(_target_row(label, data["delta"][figure], targets[figure], source))
        if kind(data) == "async_save":
            figures, targets = data["figures"], data["targets"]
            rows.append(_target_row("async save: time a step is blocked / synchronous save's",
                                    figures["async_over_sync_blocked"], targets["async_over_sync_blocked"], source))
            rows.append(_target_row("async save: slowest step outside staging / median",
                                    figures["async_max_step_over_median"], targets["async_max_step_over_median"],
                                    source))
            noise = data.get("noise_reference")
            if noise is not None:  # the synchronous run's steps, no save in flight: the machine's own spread
                rows.append(_row(["(noise) sync run, no save in flight: slowest step / median",
                                  _times(noise["sync_max_step_over_median"]), "reference", "-", source]))
    if not rows:
        return []
    return ["| figure | measured | target | met | source |", "|---|---|---|---|---|", *rows]


def hf_io_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    rows = []
    for name, data in results:
        if kind(data) != "hf_io":
            continue
        for bridge, t in data["bridges"].items():
            tensors = f"{t['tensors']}{' (MTP head included)' if t.get('mtp') else ' (no MTP head)'}"
            rows.append(_row([bridge, tensors, f"{t['bytes'] / 1e9:.2f} GB", _seconds(t["build_and_load_s"]),
                              _seconds(t["raw_read_s"]), _times(t["load_vs_raw_read"]), _seconds(t["save_s"]),
                              _seconds(t["raw_write_s"]), _times(t["save_vs_raw_write"]), f"[{sources[name]}]"]))
    if not rows:
        return []
    return ["| bridge | tensors | size | build + load | raw read | ratio | save | raw write | ratio | source |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows]


def _tree_loss_cells(loss: dict[str, Any]) -> list[str]:
    """The batch loss against the flat layouts' band, the per-sequence losses against the furthest flat layout,
    and the fp32 per-sequence difference (`tree.py`'s loss check)."""
    per_sequence, fp32 = loss["per_sequence"], loss.get("fp32")

    def verdict(within: bool) -> str:
        return "within" if within else "outside"

    furthest_flat = max(per_sequence["flat_layout_minus_others_mean_max_abs"].values())
    if fp32 is None:
        fp32_cell = "n/a"
    elif "error" in fp32:
        fp32_cell = f"failed: {fp32['error'][:80]}"
    else:
        fp32_cell = (f"{fp32['per_sequence']['tree_minus_flat_mean_max_abs']:.1e} "
                     f"({fp32['per_sequence']['sequences']} sequences)")
    return [
        f"{loss['tree_minus_flat_mean']:+.1e} vs {loss['flat_band']:.1e} ({loss['flat_layouts']} flat, "
        f"{loss.get('tree_layouts', 1)} tree layouts): "
        + verdict(loss["tree_within_flat_noise"]),
        f"{per_sequence['tree_minus_flat_mean_max_abs']:.1e} vs {furthest_flat:.1e}: "
        + verdict(per_sequence["tree_within_flat_noise"]),
        fp32_cell,
    ]


def tree_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    """P6: tree packing against flat packing of the same GRPO-like batch (`tree.py`)."""
    rows = []
    for name, data in results:
        if kind(data) != "tree":
            continue
        batch, runs, ratio, loss = data["batch"], data["runs"], data["tree_over_flat"], data["loss"]
        rows.append(_row([
            f"{batch['sequences']} sequences, {batch['original_tokens']} tokens",
            f"{batch['tree_token_ratio']:.3f}", _tokens(runs["flat"]["original_tokens_per_s"]),
            _tokens(runs["tree"]["original_tokens_per_s"]), _times(ratio["original_tokens_per_s"]) + " (>= 3x)",
            _times(ratio["step_time"]), _times(ratio["peak_memory"]), *_tree_loss_cells(loss),
            str(data["recompiles_after_warmup"]), f"[{sources[name]}]",
        ]))
    if not rows:
        return []
    return ["| batch | tree tokens / original | flat original tokens/s | tree original tokens/s | tree / flat "
            "(target) | step time tree / flat | peak memory tree / flat | batch loss: tree - flat mean vs flat "
            "band | per-sequence loss: tree max abs diff vs furthest flat layout's | fp32 per-sequence max abs diff "
            "| recompiles after warm-up | source |", "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def portable(command: str) -> str:
    """A recorded command without the measuring machine's folders: the output folder becomes `$OUT`, a checkpoint
    path `$CHECKPOINT`, so the README names what to type rather than where one run happened to write."""
    command = re.sub(r"--out \S*/([^/\s]+)", r"--out $OUT/\1", command)
    command = re.sub(r"\bOUT=\S+", "OUT=$OUT", command)
    return re.sub(r"(--checkpoint|--qwen3-8b) \S+", r"\1 $CHECKPOINT", command)


def _source_line(number: int, name: str, data: dict[str, Any]) -> str:
    versions = ", ".join(f"{package} {version}" for package, version in (data.get("versions") or {}).items()
                         if version is not None)
    driver = f" (run by `{portable(data['driver'])}`)" if data.get("driver") else ""
    return (f"[{number}] `{name}`: `{portable(data.get('command', 'command not recorded'))}`{driver}; "
            f"{data.get('device', 'device not recorded')}; {versions}; {data.get('date', 'date not recorded')}")


def render(results: list[Result]) -> str:
    known = [(name, data) for name, data in results if kind(data) is not None]
    sources = {name: number for number, (name, _) in enumerate(known, start=1)}
    sections = []
    for title, table in (("Training step", training_table(known, sources)),
                         ("Targets", targets_table(known, sources)),
                         ("HF checkpoint load and save", hf_io_table(known, sources)),
                         ("Packed, padded and full rows (P5)", packing_table(known, sources)),
                         ("Tree packing vs flat packing (P6)", tree_table(known, sources)),
                         ("Gated DeltaNet layer: fla's kernels vs the PyTorch path", gdn_table(known, sources))):
        if table:
            sections.append("\n".join([f"**{title}**", "", *table]))
    sources_section = [_source_line(sources[name], name, data) for name, data in known]
    skipped = [name for name, data in results if kind(data) is None]
    if skipped:
        sources_section.append(f"(skipped, not a known benchmark: {', '.join(skipped)})")
    sections.append("\n".join(["Sources:", "", *(f"- {line}" for line in sources_section)]))
    return "\n\n".join(sections) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, default=[DEFAULT_RESULTS],
                        help="JSON files or folders of them (default: bench/results)")
    args = parser.parse_args()
    print(render(load(args.paths)), end="")


if __name__ == "__main__":
    main()
