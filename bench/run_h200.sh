#!/usr/bin/env bash
# The benchmarks on one GPU, from the repository root:
#
#   OUT=/path/to/results bash bench/run_h200.sh                    # every step (longer than one 10-minute call)
#   OUT=/path/to/results STEPS="packing tree vl" bash bench/run_h200.sh   # only these steps
#
# Steps (each writes $OUT/<step>.json with the exact command, GPU, library versions and date inside, and its log):
#   lightning_overhead  P1+P2 plain Megatron-Core loop vs Lightning joint vs Lightning MTP-only (0.6B checkpoint)
#   hf_io               P3    each bridge's HF load/save vs raw safetensors I/O (0.6B checkpoint)
#   attention           P4    plain HF transformers Qwen3 (and Megatron-Core without MTP, SDPA)
#   packing             P5    packed vs padded vs full rows; CP all-gather volume from a gloo run
#   tree                P6    tree packing vs flat packing of a GRPO-like batch
#   mtp_memory          P2    MTP-only memory and step time vs joint and vs the plain MTP-only loop, 0.6B and 8B
#   mtp_tv                    issue 42: the 0.6B shape of mtp_memory with the self-distillation, TV and TV+KL
#                             MTP-only arms only (TV step <= 1.1x self-distillation's; not default)
#   trunk_cache         P2    MTP-only epochs from the trunk cache vs joint (0.6B) and the plain MTP-only loop (8B)
#   hf_io_8b            P3    HF load/save at the Qwen3-8B shape (untied, one MTP layer)
#   weight_sync         P7    WeightSync disk / colocated at the Qwen3-8B shape; delta syncs after MTP-only training
#                             and the LoRA adapter-only version against full syncs (the LoRA run's merged one and
#                             the plain model's), with a cProfile of each delta kind in the JSON
#   weight_sync_delta         weight_sync's delta syncs only (MTP-only and LoRA adapter; ~80 s; not default)
#   moe                       MoE (16 experts, top 4) vs the dense model of the same active FLOPs
#   sizes                     issue 41: Qwen3-8B LoRA, 4B full SFT, 0.6B SFT + MTP (default, eager, graphed) and
#                             30B-A3B LoRA, packed rows of 4096, each beside the plain Megatron-Core loop (~6 min)
#   sizes_offload             issue 41: Qwen3-8B full SFT with 3/4 of the optimizer in host memory (not default)
#   sizes_mtp                 issue 41: the three 0.6B SFT + MTP runs of `sizes` only, 3 rounds each (Lightning /
#                             plain at the 1% bound; not default)
#   norms                     issue 41: RMSNorm forward + backward at the Qwen3-0.6B/4B/8B norm shapes, torch's
#                             kernels against the compiled ones of _compat/fast_rms_norm.py (~1 min, estimated)
#   rope                      issue 41: RoPE forward + backward at the Qwen3-0.6B/8B query and key shapes,
#                             Megatron-Core's unfused kernels against the compiled ones of _compat/fast_rope.py
#                             (under a minute, estimated)
#   cross_entropy             issue 41: the LM cross-entropy forward + backward at the Qwen3-0.6B/8B logits
#                             [4096, 151936], Megatron-Core's fused (native) one against the compiled one of
#                             _compat/fast_cross_entropy.py (about a minute, estimated)
#   swiglu                    issue 41: the MLP's SwiGLU forward + backward at the Qwen3-0.6B/4B/8B widths,
#                             Megatron-Core's unfused kernels against the compiled ones of _compat/fast_swiglu.py
#                             and Megatron-Core's own fused one (under a minute, estimated)
#   sizes_swiglu              issue 41: sizes' qwen3_0.6b_mtp_default step with LIGHTNING_MEGATRON_FAST_SWIGLU=1,
#                             then =0 (sizes_swiglu_on.json, sizes_swiglu_off.json; not default; ~4 min, estimated)
#   packing_graphed           P5 with every layout graphed (full, packed, padded: the default's path, cuda_graph
#                             auto, on a GPU; not default)
#   packing_varlen            issue 41: packed rows through varlen_attn against flex_attention, eager and graphed
#                             steps and the core attention alone (not default; about 4 minutes, estimated)
#   vl                        Qwen2.5-VL-3B shape, image + text SFT, packed vs padded rows at 4096
#   gputests                  every `-m gpu` test (CI has no GPU), in seven processes at once: $OUT/gputests.log, the
#                             step fails if one does
#   async_save                a save's blocked time, async vs sync, and the step times around it (Qwen3-8B shape,
#                             MTP-only; checkpoints to /dev/shm, removed afterwards)
#   families                  issue 40: Qwen3.5-2B and GLM-4.5-Air (cut to what the GPU holds), joint and MTP-only
#                             beside the plain MTP-only loop, and the gated DeltaNet layer with fla's kernels against
#                             the PyTorch path (fla-core installed first from $WHEELS, default .whl, when carried
#                             there: fla_core-*.whl and einops-*.whl; without it the PyTorch path runs and the layer
#                             comparison is skipped with the reason)
#   families_glm              issue 40: the GLM-4.5-Air MTP-only comparison of `families` alone (no DeltaNet layer;
#                             86 s on an H100 at its 3-layer cut; not default)
#   sizes_moe_lora            issue 41: the Qwen3-30B-A3B LoRA configuration of `sizes` alone (it needs more than an
#                             80 GB card; not default)
# Recipes (not in the default list: each wants a call of its own), their JSON and figure copied into $OUT:
#   mtp_quality               python -m lightning_megatron.recipes.mtp_quality --size gpu (928 s on an H100)
#   mtp_quality_long          the same with --variants self_distill tv_kl --mtp-only-steps 400: (a) and the KL/TV
#                             blend trained past the early phase where TV lags (530 s on an H100)
#   mtp_quality_400           the same with --variants tv_kl tv_kl_k3 labels_continuations --mtp-only-steps 400:
#                             the KL/TV blend at depth 1 and at depths 1..3, and (c), all at 400 steps, paired (655 s
#                             on an H100; (a) at 400 steps is mtp_quality_long's)
#   mtp_quality_depths        the same with --variants tv_kl tv_kl_k3_decay: depths 1..3 weighted 4:2:1 against
#                             depth 1, paired (556 s on an H100, `h100_2026-12-06d`)
#   mtp_quality_sampled       the same with --variants self_distill tv_kl tv_kl_sampled --mtp-only-steps 400: the
#                             KL/TV blend on the corpus and on the model's own samples at T = 1 (on-policy
#                             contexts), beside (a), paired (469 s on an H100, `h100_2026-12-07`)
#   mtp_quality_distill_depths  the same with --variants self_distill self_distill_k3 self_distill_k3_decay
#                             --mtp-only-steps 400: (a) at depth 1, at depths 1..3 and at depths 1..3 weighted 4:2:1,
#                             paired (463 s on an H100, `h100_2026-12-07c`)
#   mtp_quality_800           the same with --variants self_distill tv_kl self_distill_k3_decay --mtp-only-steps 800:
#                             whether the KL/TV blend and the 4:2:1 depths pull ahead of (a) when trained twice as long
#                             (750 s on an H100, `h100_2026-12-07d`: they do not)
#   mtp_quality_1600          the same with --variants self_distill tv_kl --mtp-only-steps 1600: whether the
#                             acceptance still climbs at twice mtp_quality_800's steps, and whether the blend pulls
#                             ahead there (832 s on an H100, `h100_2026-12-07e`: +0.02 for each, still level)
#   mtp_quality_own_samples   the same with --variants self_distill self_distill_sampled --sample-prompts 8192
#                             --mtp-only-steps 800: (a) on the corpus against (a) on the model's own T = 1 samples
#                             of 8,192 training prompts (about a million tokens), the texts the speculative rate is
#                             measured on (`h100_2026-12-07e`); about 18 minutes on an H100, estimated (sampling
#                             ~2,000 tokens/s): a call of its own
#   mtp_drift                 python -m lightning_megatron.recipes.mtp_drift --size gpu (the RL drift benchmark,
#                             three rounds, 1,166 s on an H100)
# The 0.6B checkpoint (one MTP layer) is made under /tmp first when a step needs it (CHECKPOINT overrides where).
# bench/report.py then writes the markdown tables to $OUT/table.md. A failed step prints the end of its log; the
# others still run, and the exit status is 1. Packages come from PYTHONPATH=/tmp/site:. (wheels installed with
# pip --target /tmp/site).
#
# Disk (the whole default list fits a 64 GiB disk): every step makes its temporary folders with
# bench.common.scratch_dir, which checks the free space the step needs before it writes (a step that cannot fit
# fails at once, naming the folder, the bytes and TMPDIR) and removes the folder when the step ends, failed or not.
# Peaks: the 0.6B checkpoint 1.3 GB and the 8B one 17.7 GB, both made once under /tmp and reused by the steps after;
# hf_io 2.7 GB; tree 1.3 GB; hf_io_8b 36 GB and weight_sync 38 GB, written to RAM (BIG_TMPDIR, default /dev/shm:
# their write targets are for a RAM-backed folder); async_save 19 GB in /dev/shm; the rest (and the GPU tests'
# pytest folders) a few MB. At the end the checkpoints this script made are removed (KEEP_CHECKPOINTS=1 keeps them
# for a next call; a CHECKPOINT or CHECKPOINT_8B you set is never removed), and a call that starts removes what a
# killed earlier one left in the temporary folders (names starting with lightning_megatron_bench.).
set -uo pipefail
: "${OUT:?set OUT to the folder the JSON results go to}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}"
STEPS="${STEPS:-gputests lightning_overhead hf_io attention packing tree mtp_memory trunk_cache hf_io_8b weight_sync moe vl async_save families sizes norms rope cross_entropy swiglu}"
export BENCH_DRIVER="OUT=$OUT STEPS=\"$STEPS\" bash bench/run_h200.sh"
OWN_CHECKPOINTS=()
[ -z "${CHECKPOINT:-}" ] && OWN_CHECKPOINTS+=(/tmp/qwen3-0.6b-mtp)
[ -z "${CHECKPOINT_8B:-}" ] && OWN_CHECKPOINTS+=(/tmp/qwen3-8b-mtp)
CHECKPOINT="${CHECKPOINT:-/tmp/qwen3-0.6b-mtp}"
CHECKPOINT_8B="${CHECKPOINT_8B:-/tmp/qwen3-8b-mtp}"
BIG_TMPDIR="${BIG_TMPDIR:-/dev/shm}"
SCRATCH="$(python3 -c 'import tempfile; print(tempfile.gettempdir())')"
failed=0

remove_scratch() {  # what a step killed before its `finally` (a call's time limit) left behind
    rm -rf "$SCRATCH"/lightning_megatron_bench.* "$BIG_TMPDIR"/lightning_megatron_bench.* \
        /dev/shm/async_save_bench/lightning_megatron_bench.*
}

finish() {
    remove_scratch
    if [ "${KEEP_CHECKPOINTS:-0}" != 1 ] && [ ${#OWN_CHECKPOINTS[@]} -gt 0 ]; then
        rm -rf "${OWN_CHECKPOINTS[@]}"
    fi
}
remove_scratch
trap finish EXIT

step() {
    local name=$1
    shift
    local started=$SECONDS
    echo "== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then
        echo "   done in $((SECONDS - started)) s"
    else
        echo "   FAILED after $((SECONDS - started)) s; end of $OUT/$name.log:"
        tail -n 40 "$OUT/$name.log"
        failed=1
    fi
}

gpu_tests() {  # pytest processes at once (the longest tests fit their CUDA graphs, compile, or start fresh Python
    # processes): each group below is one process, balanced on the H100 run's durations (bench/results/
    # h100_2026-12-05b/gputests.log), and one more runs every other test; a group leaves out the others' paths
    local groups=("tests/cuda_graphs" "tests/bench tests/test_optimizer.py tests/test_attention_varlen.py"
                  "tests/_compat/test_fast_rms_norm.py tests/_compat/test_fast_rope.py"
                  "tests/_compat/test_fast_cross_entropy.py tests/_compat/test_grouped_experts.py tests/_compat/test_fast_swiglu.py tests/_compat/test_grouped_experts_layout.py tests/_compat/test_moe_permutation.py"
                  "tests/_compat" "tests/cli tests/callbacks")
    local every=() group index=0 rc=0 pids=() logs=() paths skip
    for group in "${groups[@]}"; do read -ra paths <<<"$group"; every+=("${paths[@]}"); done
    for group in "${groups[@]}" ""; do
        index=$((index + 1))
        logs+=("$SCRATCH/lightning_megatron_bench.gputests_$index.log")
        paths=(tests)
        [ -n "$group" ] && read -ra paths <<<"$group"  # a group is its paths, separated by spaces
        skip=()
        for path in "${every[@]}"; do
            [[ " ${paths[*]} " == *" $path "* ]] || skip+=(--ignore="$path")
        done
        # -v: each test named with its outcome as it ends, so a process that crashes still shows where it was
        python3 -m pytest -m gpu -v -rfE -p no:cacheprovider "${paths[@]}" "${skip[@]}" \
            --basetemp "$SCRATCH/lightning_megatron_bench.gputests_$index" >"${logs[-1]}" 2>&1 &
        pids+=($!)
    done
    for index in "${!pids[@]}"; do
        wait "${pids[$index]}" || rc=1
        cat "${logs[$index]}"
    done
    return $rc
}

install_fla() {  # fla-core (the gated DeltaNet's Triton kernels; pure Python, needs einops) from carried wheels
    local wheels="${WHEELS:-.whl}"
    python3 -c 'import fla' 2>/dev/null && return 0
    if ! compgen -G "$wheels/fla_core-*.whl" >/dev/null; then
        echo "   no $wheels/fla_core-*.whl carried: the DeltaNet layers run the PyTorch path"
        return 0
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/fla_core-*.whl \
        $(compgen -G "$wheels/einops-*.whl") || echo "   installing fla-core failed: the DeltaNet layers run the PyTorch path"
}

recipe() {  # a recipe's run in the scratch folder, with any further arguments; its summary and figure into $OUT
    # under the step's name (the checkpoints stay behind)
    local step=$1 name=$2 folder="$SCRATCH/lightning_megatron_bench.$1" rc=0
    shift 2
    python3 -m "lightning_megatron.recipes.$name" "$folder" --size gpu "$@" || rc=1
    cp "$folder/$name.json" "$OUT/$step.json" 2>/dev/null || rc=1
    cp "$folder/$name.png" "$OUT/$step.png" 2>/dev/null || rc=1
    return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1 || true
case " $STEPS " in
    *" lightning_overhead "*|*" hf_io "*) step make_checkpoint python3 -m bench.make_checkpoint "$CHECKPOINT" ;;
esac
for name in $STEPS; do
    case $name in
        lightning_overhead) step "$name" python3 -m bench.lightning_overhead --checkpoint "$CHECKPOINT" --out "$OUT/$name.json" ;;
        hf_io) step "$name" python3 -m bench.hf_io --checkpoint "$CHECKPOINT" --repeats 3 --out "$OUT/$name.json" ;;
        attention) step "$name" python3 -m bench.attention --variants hf sdpa --steps 10 --warmup 3 --out "$OUT/$name.json" ;;
        gputests) step "$name" gpu_tests ;;
        packing) step "$name" python3 -m bench.packing --markdown "$OUT/packing_profile.md" --out "$OUT/$name.json" ;;
        tree|mtp_memory|trunk_cache|moe|vl|async_save|sizes|norms|rope|cross_entropy|swiglu) step "$name" python3 -m "bench.$name" --out "$OUT/$name.json" ;;
        sizes_swiglu) for switch in on off; do
                          step "${name}_$switch" env LIGHTNING_MEGATRON_FAST_SWIGLU=$([ $switch = on ] && echo 1 || echo 0) \
                              python3 -m bench.sizes --configs qwen3_0.6b_mtp_default --out "$OUT/${name}_$switch.json"
                      done ;;
        sizes_offload) step "$name" python3 -m bench.sizes --configs qwen3_8b_full_offload --out "$OUT/$name.json" ;;
        sizes_mtp) step "$name" python3 -m bench.sizes --configs qwen3_0.6b_mtp_default qwen3_0.6b_mtp_eager \
                       qwen3_0.6b_mtp_graphed --rounds 3 --out "$OUT/$name.json" ;;
        packing_graphed) step "$name" python3 -m bench.packing --layouts full_graph packed_graph padded_graph \
                             --no-upstream-rope --no-context-parallel --markdown "$OUT/packing_graphed_profile.md" \
                             --out "$OUT/$name.json" ;;
        packing_varlen) step "$name" python3 -m bench.packing --layouts packed packed_varlen packed_graph \
                            packed_graph_varlen --no-upstream-rope --no-context-parallel \
                            --markdown "$OUT/packing_varlen_profile.md" --out "$OUT/$name.json" ;;
        mtp_tv) step "$name" python3 -m bench.mtp_memory --shapes qwen3_0.6b --variants mtp_only_self_distill \
                    mtp_only_tv mtp_only_tv_kl --breakdown-steps 0 --out "$OUT/$name.json" ;;
        hf_io_8b) step "$name" env TMPDIR="$BIG_TMPDIR" \
                      python3 -m bench.hf_io --qwen3-8b "$CHECKPOINT_8B" --repeats 3 --out "$OUT/$name.json" ;;
        weight_sync) step "$name" env TMPDIR="$BIG_TMPDIR" \
                         python3 -m bench.weight_sync --checkpoint "$CHECKPOINT_8B" --profile-deltas \
                         --out "$OUT/$name.json" ;;
        weight_sync_delta) step "$name" env TMPDIR="$BIG_TMPDIR" \
                               python3 -m bench.weight_sync --checkpoint "$CHECKPOINT_8B" --parts delta \
                               --profile-deltas --out "$OUT/$name.json" ;;
        families) install_fla; step "$name" python3 -m bench.families --out "$OUT/$name.json" ;;
        families_glm) step "$name" python3 -m bench.families --families glm4_5_air --no-gdn --out "$OUT/$name.json" ;;
        sizes_moe_lora) step "$name" python3 -m bench.sizes --configs qwen3_30b_a3b_lora --out "$OUT/$name.json" ;;
        mtp_quality|mtp_drift) step "$name" recipe "$name" "$name" ;;
        mtp_quality_long) step "$name" recipe "$name" mtp_quality --variants self_distill tv_kl --mtp-only-steps 400 ;;
        mtp_quality_400) step "$name" recipe "$name" mtp_quality --variants tv_kl tv_kl_k3 labels_continuations \
                             --mtp-only-steps 400 ;;
        mtp_quality_depths) step "$name" recipe "$name" mtp_quality --variants tv_kl tv_kl_k3_decay \
                                --mtp-only-steps 400 ;;
        mtp_quality_sampled) step "$name" recipe "$name" mtp_quality --variants self_distill tv_kl tv_kl_sampled \
                                 --mtp-only-steps 400 ;;
        mtp_quality_distill_depths) step "$name" recipe "$name" mtp_quality --variants self_distill self_distill_k3 \
                                        self_distill_k3_decay --mtp-only-steps 400 ;;
        mtp_quality_800) step "$name" recipe "$name" mtp_quality --variants self_distill tv_kl self_distill_k3_decay \
                             --mtp-only-steps 800 ;;
        mtp_quality_1600) step "$name" recipe "$name" mtp_quality --variants self_distill tv_kl --mtp-only-steps 1600 ;;
        mtp_quality_own_samples) step "$name" recipe "$name" mtp_quality --variants self_distill self_distill_sampled \
                                     --sample-prompts 8192 --mtp-only-steps 800 ;;
        *) echo "unknown step $name"; failed=1 ;;
    esac
done
if compgen -G "$OUT/*.json" >/dev/null; then  # a gputests-only call writes no JSON: nothing to tabulate
    python3 -m bench.report "$OUT"/*.json >"$OUT/table.md" && cat "$OUT/table.md" || failed=1
fi
exit $failed
