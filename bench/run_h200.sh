#!/usr/bin/env bash
# Issue 8's four benchmarks on one GPU in one command (about 5 minutes on an H200), from the repository root:
#
#   OUT=/path/to/results bash bench/run_h200.sh
#
# Makes the Qwen3-0.6B-shaped checkpoint with one MTP layer under /tmp (CHECKPOINT overrides where), then runs
#   P1+P2  bench/lightning_overhead.py  plain Megatron-Core loop vs Lightning joint vs Lightning MTP-only
#   P2     bench/mtp_memory.py          0.6B and 8B shapes: MTP-only vs joint vs plain MTP-only loop, peak breakdown
#   P3     bench/hf_io.py               each bridge's HF load/save vs raw safetensors I/O
#   P4     bench/attention.py           plain HF transformers Qwen3 (and Megatron-Core without MTP, SDPA)
# Each writes its JSON (exact command, GPU, library versions, date inside) into $OUT and its log beside it;
# bench/report.py then writes the markdown table to $OUT/table.md and prints it. A failed benchmark prints the
# end of its log; the others still run, and the exit status is 1.
# Packages come from PYTHONPATH=/tmp/site:. (the wheels installed with pip --target /tmp/site).
set -uo pipefail
: "${OUT:?set OUT to the folder the JSON results go to}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}"
export BENCH_DRIVER="OUT=$OUT bash bench/run_h200.sh"
CHECKPOINT="${CHECKPOINT:-/tmp/qwen3-0.6b-mtp}"
failed=0

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

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1 || true
step make_checkpoint python3 -m bench.make_checkpoint "$CHECKPOINT"
[ "$failed" = 0 ] || exit 1
step lightning_overhead python3 -m bench.lightning_overhead --checkpoint "$CHECKPOINT" \
    --out "$OUT/lightning_overhead.json"
step mtp_memory python3 -m bench.mtp_memory --out "$OUT/mtp_memory.json" --breakdown-md "$OUT/mtp_memory_breakdown.md"
step hf_io python3 -m bench.hf_io --checkpoint "$CHECKPOINT" --repeats 3 --out "$OUT/hf_io.json"
step attention python3 -m bench.attention --variants hf sdpa --steps 10 --warmup 3 --out "$OUT/attention.json"
python3 -m bench.report "$OUT"/*.json >"$OUT/table.md" && cat "$OUT/table.md" || failed=1
exit $failed
