#!/usr/bin/env bash
# The prepared GPU check (issue 20), for the first machine with NVIDIA GPUs: in under 8 minutes it runs
#   1. tests/test_gpu.py (every CUDA/NCCL test; they skip without GPUs),
#   2. `distfn test --gpu` (a self-spawned NCCL job: all-reduce, barrier, checkpoint round trip, DDP step),
#   3. the step benchmark on CUDA over NCCL (distfn vs the hand-written DDP loop, bit-identical weights).
# Each step has its own time limit; one failing does not stop the others. Results go to $OUT (a folder the
# caller collects) or bench/results/gpu-<time>/: summary.txt, one log per step, step.json, nvidia-smi.txt,
# env.txt. Exit status: 0 when every step passed. Usage, from the repository root with the venv active:
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

out=${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log, one summary line
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name: $*" >&2
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    printf '%-16s exit %-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$*" | tee -a "$summary"
    [ "$rc" -eq 0 ] || failed=1
    tail -n 15 "$out/$name.log" >&2
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (no driver?)" >> "$out/nvidia-smi.txt"
python -m distfn env > "$out/env.txt" 2>&1

step gpu-tests 240 python -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider --timeout 200
step distfn-test-gpu 60 python -m distfn test --gpu
step bench-step 140 python bench/bench_step.py --gpu --rounds 3 --steps 60 --warmup 15 --json "$out/step.json"

echo "results in $out" | tee -a "$summary"
exit "$failed"
