"""Markdown tables from the benchmarks' JSON, for the README: `python -m bench.report [FILES OR FOLDERS]`.

Reads `bench/results/*.json` by default. Knows the JSON of `lightning_overhead.py` (P1, P2), `mtp_memory.py` (P2
per model shape, against the plain Megatron-Core MTP-only loop), `trunk_cache.py`, `families.py` (the same per
family, and its gated DeltaNet layer comparison), `gdn.py`, `hf_io.py` (P3), `attention.py` (P4, and the older
attention results without MFU), `packing.py` (P5), `tree.py` (P6), `weight_sync.py` (P7), `async_save.py` and
`sizes.py` and `norms.py` (issue 41); other JSON files are skipped with a note. Prints a training-step table, the
sizes table, a table of the ratios against their targets, an HF load/save table, the packing layouts and the source
of every figure (command, device, versions, date).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from bench.report_cells import Result, gib, kind, percent, row, seconds, times, tokens
from bench.report_kernels import gdn_table, norms_table

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def load(paths: list[Path]) -> list[Result]:
    """`(file name, parsed JSON)` for every JSON file given or inside a folder given, in name order."""
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(path.glob("*.json")) if path.is_dir() else [path])
    return [(file.name, json.loads(file.read_text())) for file in files]


def _step_row(label: str, figures: dict[str, Any] | None, ratio: str, source: str) -> str | None:
    if figures is None:
        return None
    return row([label, seconds(figures.get("step_s")), tokens(figures.get("tokens_per_s")),
                percent(figures.get("mfu")), gib(figures.get("peak_memory_gib")), ratio, source])


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
                      f"{times(overhead.get('lightning_over_plain_step_time'))} plain step time", source),
            _step_row(f"lightning_megatron, MTP-only (`MTPOnlyCallback`){precision}", runs.get("mtp_only"),
                      f"{times(mtp_only.get('step_time_ratio'))} joint step time, "
                      f"{times(mtp_only.get('peak_memory_ratio'))} joint peak memory"
                      + (f" ({times(mtp_only['peak_memory_ratio_including_setup'])} with set-up)"
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
        vs_ours = (f"ours (joint, with MTP): {times(joint_step / hf['step_s'])} its step time"
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
    "mtp_only_over_joint_peak_memory": ("MTP-only / joint peak memory", times, "x"),
    "mtp_only_over_joint_step_time": ("MTP-only / joint step time", times, "x"),
    "mtp_only_peak_memory_gib": ("MTP-only peak memory", gib, " GiB"),
    "mtp_only_step_s": ("MTP-only step time", seconds, " s"),
    "mtp_only_over_plain_mtp_only_step_time": ("MTP-only / plain MTP-only loop step time", times, "x"),
    "mtp_only_over_plain_mtp_only_peak_memory": ("MTP-only / plain MTP-only loop peak memory", times, "x"),
}


def _shape_label(shape_name: str, shape: dict[str, Any]) -> str:
    return shape.get("label") or shape_name.replace("qwen3_", "Qwen3-").replace("b", "B")


def _mtp_memory_rows(data: dict[str, Any], source: str) -> list[str | None]:
    rows: list[str | None] = []
    for shape_name, shape in data["shapes"].items():
        if "runs" not in shape:  # a families cut that did not fit, or a part that failed
            why = shape.get("skipped") or "failed: " + shape.get("error", "no runs").strip().splitlines()[-1][:100]
            rows.append(row([_shape_label(shape_name, shape), why, "", "", "", "", source]))
            continue
        figures = shape.get("figures", {})
        ratios = {
            "joint": "reference",
            "mtp_only": ", ".join(text for text in (
                f"{times(figures['mtp_only_over_joint_step_time'])} joint step time, "
                f"{times(figures['mtp_only_over_joint_peak_memory'])} joint peak memory"
                if figures.get("mtp_only_over_joint_step_time") is not None else "",
                f"{times(figures['mtp_only_over_plain_mtp_only_step_time'])} plain loop's step time, "
                f"{times(figures.get('mtp_only_over_plain_mtp_only_peak_memory'))} plain loop's peak memory"
                if figures.get("mtp_only_over_plain_mtp_only_step_time") is not None else "",
                f"{times(figures['mtp_only_over_plain_mtp_only_peak_reserved'])} plain loop's peak reserved "
                "(allocated and cached, graph pools included)"
                if figures.get("mtp_only_over_plain_mtp_only_peak_reserved") is not None else "") if text),
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
            label, formatter, unit = _MTP_MEMORY_FIGURES.get(figure, (figure, times, ""))
            value = shape.get("figures", {}).get(figure)
            met = "n/a" if value is None else ("yes" if value <= target else "no")
            rows.append(row([f"{prefix} {_shape_label(shape_name, shape)} {label}", formatter(value),
                             f"<= {target}{unit}", met, source]))
    return rows


def _target_row(figure: str, value: float | None, target: float, source: str) -> str:
    met = "n/a" if value is None else ("yes" if value <= target else "no")
    return row([figure, times(value), f"<= {target}x", met, source])


def _at_least_row(figure: str, value: float | None, target: float, formatter: Any, source: str) -> str:
    met = "n/a" if value is None else ("yes" if value >= target else "no")
    return row([figure, formatter(value), f">= {formatter(target)}", met, source])


def _packing_target_rows(data: dict[str, Any], source: str) -> list[str]:
    """P5: packed rows against full and padded rows, eager and through `cuda_graph="full_iteration"`."""
    summary = data["summary"]
    full_over_padded = summary["target_packed_over_padded"]
    busy = summary.get("gpu_busy_fraction", {})
    speed = {name: figures.get("real_tokens_per_s") for name, figures in data["layouts"].items()}
    candidates = [
        ("P5 packed / full rows, real tokens/s (eager)", summary.get("packed_over_full_tokens_per_s"),
         summary["target_packed_over_full"], times),
        ("P5 packed / padded rows, real tokens/s (eager)", summary.get("packed_over_padded_tokens_per_s"),
         full_over_padded, times),
        ("P5 packed (graphed) / the faster full rows, real tokens/s",
         summary.get("packed_graph_over_fastest_full_tokens_per_s"), summary["target_packed_over_full"], times),
        ("P5 packed (graphed) / padded rows, real tokens/s", summary.get("packed_graph_over_padded_tokens_per_s"),
         full_over_padded, times),
        ("P5 packed / padded rows, both graphed, real tokens/s",
         summary.get("packed_graph_over_padded_graph_tokens_per_s"),
         summary.get("target_packed_over_padded_all_graphed", 3.0), times),
        ("P5 full rows (graphed), tokens/s", speed.get("full_graph"), summary["target_full_tokens_per_s"], tokens),
        ("P5 full rows (graphed), GPU busy", busy.get("full_graph"), summary["target_full_gpu_busy_fraction"],
         percent),
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
                rows.append(row([f"`{layout}`", figures["error"].splitlines()[0][:100], *[""] * 6,
                                 f"[{sources[name]}]"]))
                continue
            speed = figures["real_tokens_per_s"]
            rows.append(row([f"`{layout}`", seconds(figures["step_s"]), tokens(speed),
                             times(speed / full) if full else "n/a", percent(figures.get("gpu_busy_fraction")),
                             str(figures.get("kernel_launch_calls", "n/a")),
                             str(figures.get("graph_launch_calls", "n/a")), gib(figures.get("peak_memory_gib")),
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
        if kind(data) == "sizes":
            rows += _sizes_target_rows(data, source)
        if kind(data) == "hf_io":
            target = data.get("target_vs_raw", 1.5)
            for bridge, timings in data["bridges"].items():
                rows.append(_target_row(f"P3 {bridge} load / raw read", timings["load_vs_raw_read"], target, source))
                rows.append(_target_row(f"P3 {bridge} save / raw write", timings["save_vs_raw_write"],
                                        data.get("target_save_vs_raw", target), source))
        if kind(data) == "weight_sync":
            rows += _weight_sync_target_rows(data, source)
        if kind(data) == "async_save":
            figures, targets = data["figures"], data["targets"]
            rows.append(_target_row("async save: time a step is blocked / synchronous save's",
                                    figures["async_over_sync_blocked"], targets["async_over_sync_blocked"], source))
            rows.append(_target_row("async save: slowest step outside staging / median",
                                    figures["async_max_step_over_median"], targets["async_max_step_over_median"],
                                    source))
            noise = data.get("noise_reference")
            if noise is not None:  # the synchronous run's steps, no save in flight: the machine's own spread
                rows.append(row(["(noise) sync run, no save in flight: slowest step / median",
                                 times(noise["sync_max_step_over_median"]), "reference", "-", source]))
    if not rows:
        return []
    return ["| figure | measured | target | met | source |", "|---|---|---|---|---|", *rows]


_SIZES_FIGURES = {"tokens_per_s": ("tokens/s", tokens), "mfu": ("MFU", percent),
                  "lightning_over_plain_step_time": ("Lightning / plain step time", times)}


def _weight_sync_target_rows(data: dict, source: str) -> list[str]:
    """P7's rows, of the parts the run measured (`--parts`: sync, delta, steps)."""
    rows: list[str] = []
    targets = data["targets"]
    if "sync" in data:
        sync = data["sync"]
        rows.append(_target_row("P7 disk sync / raw write", sync["disk_sync_vs_raw_write"],
                                targets["disk_sync_vs_raw_write"], source))
        rows.append(_target_row("P7 colocated sync / disk round trip", sync["colocated_vs_disk_round_trip"],
                                targets["colocated_vs_disk_round_trip"], source))
        met = "yes" if sync["colocated_sync_s"] <= targets["colocated_sync_s"] else "no"
        rows.append(row(["P7 colocated sync of the whole model", seconds(sync["colocated_sync_s"]),
                         f"<= {targets['colocated_sync_s']} s", met, source]))
        if sync["colocated_extra_sender_memory_bytes"] is not None:
            extra = sync["colocated_extra_sender_memory_bytes"] / 2**30
            rows.append(row(["P7 extra sender GPU memory", f"{extra:.2f} GiB",
                             f"<= {sync['colocated_extra_memory_limit_bytes'] / 2**30:.2f} GiB",
                             "yes" if sync["colocated_extra_memory_within_limit"] else "no", source]))
    if "steps_between_syncs" in data:
        rows.append(_target_row("P7 step time with WeightSync / without",
                                data["steps_between_syncs"]["step_time_ratio"], targets["step_time_ratio"], source))
    for figure, label in (("delta_vs_full_disk", "P7 MTP-only delta / full sync, disk"),
                          ("delta_vs_full_colocated", "P7 MTP-only delta / full sync, colocated"),
                          ("lora_adapter_vs_merged_disk",
                           "P7 LoRA adapter-only / the LoRA run's full (merged) sync, disk, back to back"),
                          ("lora_adapter_between_steps_vs_merged_disk",
                           "P7 LoRA adapter-only / merged sync, disk, each sync after 0.5 s of steps"),
                          ("lora_adapter_vs_full_disk",
                           "P7 LoRA adapter-only / the plain model's full sync, disk (reference)")):
        if figure in data.get("delta", {}):  # results from before the merged baseline lack it
            rows.append(_target_row(label, data["delta"][figure], targets[figure], source))
    return rows


def _sizes_target_rows(data: dict[str, Any], source: str) -> list[str]:
    """Issue 41: each configuration's Lightning figures against its bounds (`bench/sizes.py`)."""
    rows = []
    for config in data["configs"].values():
        if "targets" not in config:
            continue
        lightning = config["figures"].get("lightning", {})
        label = config["settings"]["label"]
        for direction, bounds in config["targets"].items():
            for figure, bound in bounds.items():
                name, formatter = _SIZES_FIGURES.get(figure, (figure, times))
                value = lightning.get(figure)
                if direction == "at_least":
                    rows.append(_at_least_row(f"{label}: {name}", value, bound, formatter, source))
                else:
                    met = "n/a" if value is None else ("yes" if value <= bound else "no")
                    rows.append(row([f"{label}: {name}", formatter(value), f"<= {formatter(bound)}", met, source]))
    return rows


def sizes_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    """Issue 41: per configuration, the Lightning run beside the plain Megatron-Core loop (`bench/sizes.py`)."""
    rows = []
    for name, data in results:
        if kind(data) != "sizes":
            continue
        source = f"[{sources[name]}]"
        for config_name, config in data["configs"].items():
            if "skipped" in config:
                rows.append(row([f"`{config_name}`", "", f"skipped: {config['skipped']}", *[""] * 7, source]))
                continue
            label, figures = config["settings"]["label"], config["figures"]
            for run_name, rounds in config["runs"].items():
                failed = next((run for run in rounds if "error" in run), None)
                if run_name not in figures:
                    error = failed["error"].splitlines()[0][:100] if failed else "no run"
                    rows.append(row([label, run_name, f"{failed['failure'] if failed else 'n/a'}: {error}",
                                     *[""] * 7, source]))
                    continue
                run = figures[run_name]
                tflops = "n/a" if run.get("model_tflop_per_s") is None else f"{run['model_tflop_per_s']:.0f}"
                ratio = times(run.get("lightning_over_plain_step_time")) if run_name == "lightning" else "reference"
                rows.append(row([label, run_name, seconds(run["step_s"]), tokens(run["tokens_per_s"]), tflops,
                                 percent(run.get("mfu")), percent(run.get("gpu_busy_fraction")),
                                 gib(run.get("peak_memory_gib")), ratio, source]))
    if not rows:
        return []
    return ["| configuration | run | median step | real tokens/s | model TFLOP/s | MFU | GPU busy | peak GPU memory | "
            "Lightning / plain step time | source |", "|---|---|---|---|---|---|---|---|---|---|", *rows]


def hf_io_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    rows = []
    for name, data in results:
        if kind(data) != "hf_io":
            continue
        for bridge, t in data["bridges"].items():
            tensors = f"{t['tensors']}{' (MTP head included)' if t.get('mtp') else ' (no MTP head)'}"
            rows.append(row([bridge, tensors, f"{t['bytes'] / 1e9:.2f} GB", seconds(t["build_and_load_s"]),
                             seconds(t["raw_read_s"]), times(t["load_vs_raw_read"]), seconds(t["save_s"]),
                             seconds(t["raw_write_s"]), times(t["save_vs_raw_write"]), f"[{sources[name]}]"]))
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
        rows.append(row([
            f"{batch['sequences']} sequences, {batch['original_tokens']} tokens",
            f"{batch['tree_token_ratio']:.3f}", tokens(runs["flat"]["original_tokens_per_s"]),
            tokens(runs["tree"]["original_tokens_per_s"]), times(ratio["original_tokens_per_s"]) + " (>= 3x)",
            times(ratio["step_time"]), times(ratio["peak_memory"]), *_tree_loss_cells(loss),
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
    switches = "".join(f"{variable}={value} " for variable, value in (data.get("switches") or {}).items())
    return (f"[{number}] `{name}`: `{switches}{portable(data.get('command', 'command not recorded'))}`{driver}; "
            f"{data.get('device', 'device not recorded')}; {versions}; {data.get('date', 'date not recorded')}")


def render(results: list[Result]) -> str:
    known = [(name, data) for name, data in results if kind(data) is not None]
    sources = {name: number for number, (name, _) in enumerate(known, start=1)}
    sections = []
    for title, table in (("Training step", training_table(known, sources)),
                         ("Sizes users train on one GPU, beside the plain Megatron-Core loop (issue 41)",
                          sizes_table(known, sources)),
                         ("Targets", targets_table(known, sources)),
                         ("HF checkpoint load and save", hf_io_table(known, sources)),
                         ("Packed, padded and full rows (P5)", packing_table(known, sources)),
                         ("Tree packing vs flat packing (P6)", tree_table(known, sources)),
                         ("Gated DeltaNet layer: fla's kernels vs the PyTorch path", gdn_table(known, sources)),
                         ("RMSNorm: torch's kernels vs the compiled ones (issue 41)", norms_table(known, sources))):
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
