"""The tables of the kernel comparisons for `report.py`: the gated DeltaNet layer (`gdn.py`, and `families.py`'s)
and RMSNorm (`norms.py`), each the PyTorch-side path beside the faster kernels and the largest differences."""

from __future__ import annotations

from typing import Any

from bench.report_cells import Result, kind, row, seconds, times


def gdn_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    """The gated DeltaNet layer alone, fla's kernels against the PyTorch path (`gdn.py`, and `families.py`'s)."""
    rows = []
    for name, data in results:
        gdn = data if kind(data) == "gdn" else data.get("gdn") if kind(data) == "families" else None
        if not gdn:
            continue
        if "pytorch" not in gdn:
            rows.append(row(["failed: " + gdn.get("error", "").strip().splitlines()[-1][:100], *[""] * 6,
                             f"[{sources[name]}]"]))
            continue
        layer, fla = gdn["layer"], gdn["fla"]
        shape = (f"hidden {layer['hidden']}, {layer['key_heads']}/{layer['value_heads']} key/value heads of "
                 f"{layer['value_head_dim']}; {gdn['micro_batch']} x {gdn['seq']} tokens, {gdn['dtype']}")
        differences = gdn.get("difference", {})
        cells = [f"{values['max_abs']:.2e} of {values['pytorch_max_abs']:.2e}" for values in differences.values()]
        if "forward_s" in fla:  # fla refuses its backward here: the forward alone (bench/gdn.py)
            fla_cell = (f"forward only: {seconds(fla['forward_s'])} against PyTorch's "
                        f"{seconds(gdn['pytorch']['forward_s'])} (backward: {fla['backward_skipped']})")
            ratio = f"{times(gdn['pytorch_over_fla_forward'])} (forward)"
        else:
            fla_cell = (seconds(fla["forward_backward_s"]) if "forward_backward_s" in fla
                        else f"skipped: {fla.get('skipped', '')}")
            ratio = times(gdn.get("pytorch_over_fla"))
        cells += ["n/a"] * (3 - len(cells))
        rows.append(row([shape, seconds(gdn["pytorch"]["forward_backward_s"]), fla_cell, ratio, *cells,
                         f"[{sources[name]}]"]))
    if not rows:
        return []
    return ["| gated DeltaNet layer | PyTorch path fwd+bwd | fla fwd+bwd | PyTorch / fla | output: max abs diff of max "
            "| input grad | in_proj weight grad | source |", "|---|---|---|---|---|---|---|---|", *rows]


def _gpu_time(arm: dict[str, Any]) -> str:
    """An arm's forward + backward GPU time per call (its wall time where there is no GPU), or that it was skipped."""
    if "skipped" in arm:
        return "skipped"
    gpu_us = arm.get("forward_backward_gpu_us")
    return f"{arm['forward_backward_wall_us']:.0f} us (wall)" if gpu_us is None else f"{gpu_us:.1f} us"


def norms_table(results: list[Result], sources: dict[str, int]) -> list[str]:
    """RMSNorm forward + backward per call, torch's kernels against the compiled ones (`norms.py`), and per model
    what a microbatch's norms take."""
    arms, rows = ("torch", "compiled", "aten_compiled_weight_grad", "eager"), []
    for name, data in results:
        for model, shape in data["shapes"].items() if kind(data) == "norms" else ():
            for norm, figures in shape["norms"].items():
                compiled, upstream = figures["arms"]["compiled"], figures["arms"]["torch"]
                diffs = " / ".join(f"{compiled['max_abs_diff'][key]:.1e} of {compiled['reference_max_abs'][key]:.1e}"
                                   for key in compiled.get("max_abs_diff", {}))
                gpu_us = [arm.get("forward_backward_gpu_us") for arm in (compiled, upstream)]
                rows.append(row([f"{model} {norm}", f"{figures['rows']} x {figures['width']}",
                                 *(_gpu_time(figures["arms"][arm]) for arm in arms),
                                 times(gpu_us[0] / gpu_us[1]) if None not in gpu_us else "n/a", diffs or "n/a",
                                 f"[{sources[name]}]"]))
            per_microbatch = shape["per_microbatch"]
            rows.append(row([f"{model}: a microbatch's norms", f"{shape['layers']} layers",
                             *(f"{per_microbatch['gpu_ms'][arm]:.2f} ms" if arm in per_microbatch["gpu_ms"] else "n/a"
                               for arm in arms),
                             times(per_microbatch.get("compiled_over_torch")), "", f"[{sources[name]}]"]))
    if not rows:
        return []
    return ["| norm | rows x width | torch fwd+bwd (GPU) | compiled | aten + compiled weight grad | eager | compiled / "
            "torch | compiled: max abs diff to fp32 (output / input grad / weight grad) | source |",
            "|---|---|---|---|---|---|---|---|---|", *rows]
