#!/usr/bin/env bash
# The prepared GPU check (issues 20 and 32), for the first machine with NVIDIA GPUs: in under 8 minutes it runs
#   1. tests/test_gpu.py (every CUDA/NCCL test; they skip without GPUs),
#   2. `distfn test --gpu` (a self-spawned NCCL job: all-reduce, barrier, checkpoint round trip, DDP step),
#   3. the step benchmark on CUDA over NCCL (distfn vs the hand-written DDP loop, bit-identical weights),
#   4. launch on GPUs: a whole `python script.py` of a distfn NCCL job vs the raw torch.multiprocessing floor,
#   5. a save of 1 GiB of CUDA state (distfn's pinned staging vs save_file / torch.save of the same tensors) and
#      the time an asynchronous ctx.save of it blocks vs a blocking one (4 and 5: bench/bench_gpu.py --gpu).
# Each step has its own time limit (the benchmarks also stop starting rounds after --budget seconds); one
# failing does not stop the others. Results go to $OUT (a folder the caller collects) or
# bench/results/gpu-<time>/: summary.json (every figure and every step, written last), summary.txt, steps.txt,
# one log per step, step.json, gpu-launch.json, gpu-save.json, nvidia-smi.txt, env.txt.
# Exit status: 0 when every step passed. Usage, from the repository root with the venv active:
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

out=${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
: > "$out/steps.txt"
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log, one summary line
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name: $*" >&2
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    printf '%-16s exit %-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$*" | tee -a "$summary"
    echo "$name $rc $(( $(date +%s) - start ))" >> "$out/steps.txt"
    [ "$rc" -eq 0 ] || failed=1
    tail -n 15 "$out/$name.log" >&2
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (no driver?)" >> "$out/nvidia-smi.txt"
python -m distfn env > "$out/env.txt" 2>&1

step gpu-tests 150 python -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider --timeout 120
step distfn-test-gpu 40 python -m distfn test --gpu
step bench-step 100 python bench/bench_step.py --gpu --rounds 2 --steps 60 --warmup 15 --json "$out/step.json"
step gpu-launch 55 python bench/bench_gpu.py --gpu --only launch --rounds 3 --budget 25 --json "$out/gpu-launch.json"
step gpu-save 75 python bench/bench_gpu.py --gpu --only save --gib 1 --rounds 3 --budget 30 --json "$out/gpu-save.json"

python bench/bench_gpu.py --summary "$out" || failed=1
echo "results in $out" | tee -a "$summary"
exit "$failed"
