"""Issue 40 on one GPU: the families that ship MTP heads at their real sizes, joint and MTP-only against the plain loop.

Each model is built with Megatron's random initialization straight on the GPU from a config-only checkpoint (as
`mtp_memory.py` does: no weights written or read), bf16, distributed optimizer, megatron-bridge, its one MTP layer,
random tokens, seq 2048, all in this one process:

- `qwen3_5_2b`: Qwen3.5-2B's text model whole (`common.QWEN3_5_2B`: 18 gated DeltaNet and 6 gated full-attention
  layers, vocabulary 248320, tied), micro-batch 2 x 4: Lightning joint (`SFTModule(enable_mtp=True)`), Lightning
  MTP-only (`MTPOnlyCallback()`, its defaults: the main head only on the steps that log `lm_loss`, token-chunked
  cross-entropies, the frozen trunk from CUDA graphs) and the plain Megatron-Core MTP-only loop
  (`bench/megatron_loop.py`: every non-MTP parameter `requires_grad=False`, nothing else). Its DeltaNet layers run
  fla's kernels where `fla` imports, else the PyTorch path (`gdn_kernels` says which).
- `glm4_5_air`: GLM-4.5-Air (`common.GLM4_5_AIR`: 128 experts top 8, a shared expert, vocabulary 151552) cut to
  the first decoder layers that one GPU holds for MTP-only training, micro-batch 1 x 4: Lightning MTP-only and the
  plain MTP-only loop (17 of 46 layers on an H200 by the arithmetic below); `glm4_5_air_joint`: the cut that holds
  joint training (everything trained: 2 layers), Lightning joint beside Lightning MTP-only, one round. The MoE
  trunk is replayed from CUDA graphs in Lightning's MTP-only arm as in any MTP-only run (`cuda_graph_trunk`).

Targets (issue 40): MTP-only step time <= 0.95x the plain MTP-only loop's, peak memory <= the plain loop's.

How a cut is chosen (`fit`, printed and in the JSON): the device's free memory less `--reserve-gib` (activations,
the logits' chunks, the grouped GEMM's stacked expert weights, the allocator's slack) must hold the parameters and
optimizer state: 2 bytes a frozen bf16 parameter, 18 a trained one (the bf16 parameter, its fp32 gradient buffer,
fp32 main copy and Adam's two fp32 moments: the distributed optimizer on one rank). Parameters are counted per
module as megatron-core builds them (`parameter_counts`); a cut keeps at least one MoE layer, so that its MTP layer
keeps its experts. `--layers` / `--joint-layers` set the cuts instead.

Each run reports its median step, tokens/s, MFU on the FLOPs it ran (`bench/flops.py`: Megatron-LM's count, gated
DeltaNet and experts included) and its training steps' peak memory, in mirrored rounds (`mtp_memory.measure_variants`).
On a GPU, a shape compared with the plain loop also reports `mtp_only_profile`: one more short Lightning MTP-only
run with one step under `torch.profiler` (`mtp_memory.profile_mtp_only`: GPU-busy fraction, top kernels, syncs).
`gdn`: one Qwen3.5-2B DeltaNet layer, fla's kernels against the PyTorch path (`bench/gdn.py`; skipped with the reason
without fla). The JSON is rewritten after each part, so a part that fails leaves the others' figures.

`--tiny`: the tiny checkpoints of both families in fp32 on the CPU, a few steps: whole, every variant, unless
`--free-gib` gives memory to plan GLM's cuts against (on a CPU there is none to read).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    GLM4_5_AIR,
    QWEN3_5_2B,
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    fresh_memory,
    json_text,
    make_config_only_checkpoint,
    parse_with_tiny,
    scratch_dir,
    start_single_process,
)
from bench.flops import ModelShape, peak_flops
from bench.gdn import compare_kernels, fla_unavailable
from bench.lightning_overhead import Settings
from bench.mtp_memory import measure_variants, profile_mtp_only
from lightning_megatron.atomic import write_text_atomically

GIB = 1024**3
FROZEN_BYTES = 2  # a bf16 parameter
TRAINED_BYTES = 18  # bf16 parameter + fp32 gradient buffer + fp32 main parameter + Adam's two fp32 moments
TARGETS = {"mtp_only_over_plain_mtp_only_step_time": 0.95, "mtp_only_over_plain_mtp_only_peak_memory": 1.0}
VARIANTS = ("joint", "mtp_only", "plain_mtp_only")
TINY = dict(seq=32, steps=2, warmup=1, rounds=1, precision="fp32", log_every_n_steps=2, gdn_seq=64,
            gdn_repeats=2)


@dataclass(frozen=True)
class FamilyRun:
    """One family's benchmark: its real config, batch, and whether it is cut to what one GPU holds."""

    name: str
    label: str
    model_type: str
    config: dict[str, Any]
    tied: bool
    micro_batch: int
    microbatches: int
    cut: bool


QWEN3_5 = FamilyRun("qwen3_5_2b", "Qwen3.5-2B", "qwen3_5_text", QWEN3_5_2B, tied=True, micro_batch=2,
                    microbatches=4, cut=False)
FAMILIES = (
    QWEN3_5,
    FamilyRun("glm4_5_air", "GLM-4.5-Air", "glm4_moe", GLM4_5_AIR, tied=False, micro_batch=1, microbatches=4,
              cut=True),
)


@dataclass(frozen=True)
class ParameterCounts:
    """A model's parameters by part, as megatron-core builds them (norms, biases, routers included)."""

    embedding: int
    output: int  # 0 when tied to the embedding
    layers: tuple[int, ...]
    final_norm: int
    mtp: int  # its norms, projection and decoder layer (it shares the embedding and output layer)

    @property
    def total(self) -> int:
        return self.embedding + self.output + sum(self.layers) + self.final_norm + self.mtp


def _attention_parameters(shape: ModelShape, full: bool) -> int:
    h = shape.hidden
    if not full:  # GatedDeltaNet: in_proj (q, k, v, gate, beta, alpha), conv1d, dt_bias, A_log, out_norm, out_proj
        linear = shape.linear_attention
        assert linear is not None
        keys, values = linear.key_heads * linear.key_head_dim, linear.value_heads * linear.value_head_dim
        return (h * (2 * keys + 2 * values + 2 * linear.value_heads) + (2 * keys + values) * linear.conv_kernel
                + 2 * linear.value_heads + linear.value_head_dim + values * h + h)
    q, k = shape.heads * shape.head_dim, shape.kv_groups * shape.head_dim
    projected = q + 2 * k + (q if shape.output_gate else 0)  # linear_qkv's rows
    return (h * projected + q * h + (projected if shape.qkv_bias else 0) + (2 * shape.head_dim if shape.qk_norm else 0)
            + h)


def _mlp_parameters(shape: ModelShape, moe: bool) -> int:
    h = shape.hidden
    if not moe:
        return 3 * h * shape.ffn + h
    experts = shape.experts
    assert experts is not None
    return experts.experts * h + experts.experts * 3 * h * experts.ffn + 3 * h * experts.shared_ffn + h


def parameter_counts(shape: ModelShape) -> ParameterCounts:
    """Every parameter of `shape`'s model with its MTP layers (`mtp_layers`), counted per module."""
    h = shape.hidden
    layers = tuple(_attention_parameters(shape, shape.full_attention(i)) + _mlp_parameters(shape, shape.moe(i))
                   for i in range(shape.layers))
    mtp_layer = 3 * h + 2 * h * h + _attention_parameters(shape, True) + _mlp_parameters(shape, shape.mtp_moe)
    return ParameterCounts(embedding=shape.vocab * h, output=0 if shape.tied else shape.vocab * h, layers=layers,
                           final_norm=h, mtp=shape.mtp_layers * mtp_layer)


def static_bytes(shape: ModelShape, *, mtp_only: bool) -> int:
    """The parameters and optimizer state of training `shape` MTP-only (the MTP layers trained) or jointly."""
    counts = parameter_counts(shape)
    if mtp_only:
        return FROZEN_BYTES * (counts.total - counts.mtp) + TRAINED_BYTES * counts.mtp
    return TRAINED_BYTES * counts.total


def fit_layers(shape: ModelShape, budget_bytes: int, *, mtp_only: bool) -> int | None:
    """The most first decoder layers of `shape` whose `static_bytes` fit `budget_bytes`, keeping at least one MoE
    layer where the model has experts (the MTP layer's experts follow the last layer's); None when none fits."""
    least = 1 if shape.experts is None else shape.experts.moe_layers.index(True) + 1
    fitting = [layers for layers in range(least, shape.layers + 1)
               if static_bytes(shape.cut(layers), mtp_only=mtp_only) <= budget_bytes]
    return max(fitting, default=None)


def plan_cuts(shape: ModelShape, free_bytes: int, reserve_bytes: int, layers: int | None = None,
              joint_layers: int | None = None) -> dict[str, Any]:
    """The MTP-only and joint cuts for `free_bytes` of device memory less `reserve_bytes` (or the given ones), with
    the arithmetic behind them."""
    budget = free_bytes - reserve_bytes
    mtp_only = layers or fit_layers(shape, budget, mtp_only=True)
    joint = joint_layers or fit_layers(shape, budget, mtp_only=False)
    return {"free_gib": free_bytes / GIB, "reserve_gib": reserve_bytes / GIB, "budget_gib": budget / GIB,
            "frozen_bytes_per_parameter": FROZEN_BYTES, "trained_bytes_per_parameter": TRAINED_BYTES,
            "model_layers": shape.layers, "mtp_only_layers": mtp_only, "joint_layers": joint,
            "mtp_only_static_gib": None if mtp_only is None else static_bytes(shape.cut(mtp_only), mtp_only=True) / GIB,
            "joint_static_gib": None if joint is None else static_bytes(shape.cut(joint), mtp_only=False) / GIB,
            "given": {"layers": layers, "joint_layers": joint_layers}}


def describe(plan: dict[str, Any]) -> str:
    """`plan_cuts`'s arithmetic in one line."""

    def cut(what: str) -> str:
        layers = plan[f"{what}_layers"]
        return "none" if layers is None else f"{layers} ({plan[f'{what}_static_gib']:.1f} GiB)"

    return (f"{plan['free_gib']:.1f} GiB free - {plan['reserve_gib']:.1f} GiB reserve = {plan['budget_gib']:.1f} GiB "
            f"for parameters and optimizer state ({FROZEN_BYTES} B a frozen parameter, {TRAINED_BYTES} B a trained "
            f"one): of {plan['model_layers']} decoder layers MTP-only training holds {cut('mtp_only')}, joint "
            f"training {cut('joint')}")


def _measure(run: FamilyRun, args: argparse.Namespace, root: Path, label: str, variants: tuple[str, ...],
             layers: int | None = None, rounds: int | None = None) -> dict[str, Any]:
    """`variants` of `run`'s model (its first `layers` decoder layers, or all) in mirrored rounds."""
    config = run.config if layers is None else {**run.config, "num_layers": layers}
    checkpoint = make_config_only_checkpoint(root / f"{run.name}_{layers or 'all'}", config, tied=run.tied,
                                             tiny=args.tiny, family=run.model_type)
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    settings = Settings(checkpoint=str(checkpoint), seq=args.seq, micro_batch=run.micro_batch,
                        microbatches=run.microbatches, steps=args.steps, warmup=args.warmup,
                        precision=args.precision, random_weights=True, log_lm_loss_every_n_steps=None,
                        log_every_n_steps=args.log_every_n_steps)
    targets = TARGETS if "plain_mtp_only" in variants else {}
    measured = {"label": label, "family": run.model_type,
                **measure_variants(variants, settings, shape, rounds or args.rounds, args.peak_tflops, targets)}
    if targets and torch.cuda.is_available():  # where the MTP-only step's time goes, beside the plain loop's
        measured["mtp_only_profile"] = profile_mtp_only(settings, shape.vocab, measured["runs"]["mtp_only"]["step_s"])
    return measured


def run_family(run: FamilyRun, args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    """The family's shapes: whole, or (`cut`, with device memory to plan against) the MTP-only cut, beside the plain
    loop, and the joint cut, beside MTP-only (one round: no target compares them)."""
    free = (args.free_gib * GIB if args.free_gib is not None
            else torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None)
    if not run.cut or free is None:
        return {run.name: _measure(run, args, root, run.label, VARIANTS)}
    full = ModelShape.from_hf_checkpoint(make_config_only_checkpoint(root / f"{run.name}_full", run.config,
                                                                     tied=run.tied, tiny=args.tiny,
                                                                     family=run.model_type))
    plan = plan_cuts(full, int(free), int(args.reserve_gib * GIB), args.layers, args.joint_layers)
    print(f"{run.name}: {describe(plan)}", file=sys.stderr, flush=True)
    shapes: dict[str, dict[str, Any]] = {}
    for name, layers, variants, what, rounds in (
            (run.name, plan["mtp_only_layers"], ("mtp_only", "plain_mtp_only"), "MTP-only", None),
            (f"{run.name}_joint", plan["joint_layers"], ("joint", "mtp_only"), "joint", 1)):
        if layers is None:
            shapes[name] = {"label": f"{run.label} ({what})", "fit": plan,
                            "skipped": f"no cut with an MoE layer fits {what} training in the budget"}
            continue
        label = f"{run.label}, first {layers} of {full.layers} layers ({what} fits)"
        shapes[name] = {**_measure(run, args, root, label, variants, layers, rounds), "fit": plan}
    return shapes


def gdn_kernels() -> str:
    """What the gated DeltaNet layers of this process run: fla's kernels or the PyTorch path."""
    reason = fla_unavailable()
    return "fla" if reason is None else f"pytorch (_compat.gated_delta_net): {reason}"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny checkpoints, fp32, CPU-sized (explicit flags win)")
    parser.add_argument("--families", nargs="+", choices=[run.name for run in FAMILIES],
                        default=[run.name for run in FAMILIES])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--log-every-n-steps", type=int, default=50,
                        help="the Trainer's log_every_n_steps: MTP-only runs the main head on those steps only")
    parser.add_argument("--reserve-gib", type=float, default=24.0,
                        help="device memory kept out of a cut's budget (activations, logits chunks, stacked experts)")
    parser.add_argument("--layers", type=int, default=None, help="the MTP-only cut (default: what fits)")
    parser.add_argument("--joint-layers", type=int, default=None, help="the joint cut (default: what fits)")
    parser.add_argument("--free-gib", type=float, default=None,
                        help="plan the cuts against this much free device memory (default: the GPU's; on a CPU the "
                             "families run whole unless it is given)")
    parser.add_argument("--gdn-seq", type=int, default=2048, help="the DeltaNet layer comparison's sequence length")
    parser.add_argument("--gdn-repeats", type=int, default=10)
    parser.add_argument("--no-gdn", action="store_true", help="leave out the DeltaNet layer comparison")
    return parse_with_tiny(parser, TINY)


def main() -> None:
    args = _parse_args()
    start_single_process(tiny=args.tiny)
    result: dict[str, Any] = {"benchmark": "families", **environment(),
                              "peak_tflops": (peak_flops(args.peak_tflops) or 0) / 1e12 or None,
                              "gdn_kernels": gdn_kernels(), "targets": TARGETS, "shapes": {}}
    failed = []
    with scratch_dir("families_", TINY_SCRATCH_BYTES) as root:  # config-only checkpoints
        parts = [] if args.no_gdn else [("gdn", lambda: compare_kernels(
            QWEN3_5_2B, root, tiny=args.tiny, micro_batch=QWEN3_5.micro_batch, seq=args.gdn_seq,
            warmup=1 if args.tiny else 3, repeats=args.gdn_repeats,
            dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32))]
        parts += [(run.name, lambda run=run: run_family(run, args, root)) for run in FAMILIES
                  if run.name in args.families]
        for name, part in parts:
            fresh_memory()
            try:
                outcome = part()
            except Exception:  # recorded; the next part runs
                failed.append(name)
                traceback.print_exc()
                outcome = {"error": traceback.format_exc(limit=-8)}
                outcome = outcome if name == "gdn" else {name: outcome}
            if name == "gdn":
                result["gdn"] = outcome
            else:
                result["shapes"].update(outcome)
            if args.out is not None:  # after each part: a later part that fails leaves these figures
                write_text_atomically(args.out, json_text(result))
    emit(result, args.out)
    if failed:
        raise SystemExit(f"families: {', '.join(failed)} failed (their tracebacks are above and in the JSON)")


if __name__ == "__main__":
    main()
