#!/usr/bin/env bash
# The prepared GPU check (issues 20, 32 and 42), for the first machine with NVIDIA GPUs. On ONE GPU it runs in
# under 8 minutes (its limits add up to 425 s, 465 s with timeout's kill grace); every step has its own limit,
# and one failing does not stop the others:
#   1. gpu-tests: tests/test_gpu.py. On one GPU: DDP/NCCL pinning, staging, the fork probe, the bound device, PCI
#      order, and the single-GPU variants of issue 42: two gloo ranks sharing cuda:0 with CUDA tensors (a meta
#      model materialised with cpu_offload gets distinct rows equal to a single process's init; copies of GPU
#      memory still being written, from the main thread and another one, come out whole; CUDA-event timings see
#      rank 0's wait for a slow rank 1 as comm), and no timing event recorded under CUDA graph capture. The tests
#      that need 2 GPUs skip there, saying so (two NCCL ranks cannot share a GPU: "Duplicate GPU detected").
#   2. distfn-test-gpu: `distfn test --gpu` (a self-spawned NCCL job: all-reduce, barrier, checkpoint, DDP step).
#   3. gpu-hang: three world-1 NCCL jobs made to hang by torch.cuda._sleep queued before the collective: distfn's
#      deadline report at the timeout for a host-blocking ctx collective and for a CUDA tensor's ctx.all_reduce
#      (the ledger's CUDA event), none for a raw torch.distributed call, and the time of NCCL's watchdog abort in
#      each, measured (bench/bench_gpu.py --only hang -> gpu-hang.json).
#   4. gpu-save: 1 GiB of CUDA state saved by distfn vs save_file / torch.save, and how long an asynchronous
#      ctx.save of it blocks (bench/bench_gpu.py --only save -> gpu-save.json).
#   With 2 or more GPUs, also (their limits add 155 s): 5. bench-step, the step benchmark over NCCL;
#   6. gpu-launch, a whole `python script.py` of a distfn NCCL job vs the torch.multiprocessing floor. On one GPU
#   both would be world-1 figures that compare nothing, so they are left out. With 4 or more GPUs (issue 45, 150 s):
#   7. gpu-mesh, the 2-D mesh tests on CUDA and NCCL (HSDP 2x2 vs hand-written FSDP2 HSDP, TP 2 x DP 2 vs one
#   process, the checkpoint reshard matrix: tests/test_mesh.py's 4-rank job with DISTFN_BACKEND=nccl).
# Results go to $OUT (a folder the caller collects) or bench/results/gpu-<time>/: summary.json (every figure and
# every step, written last), summary.txt, steps.txt, one log per step, the benchmarks' JSON, nvidia-smi.txt,
# env.txt. Exit status: 0 when every step passed. Usage, from the repository root with the venv active:
#     bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

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

timeout 10 nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (no driver?)" >> "$out/nvidia-smi.txt"
timeout 15 python -m distfn env > "$out/env.txt" 2>&1
# the NVML count: this shell's python never initialises CUDA
gpus=$(timeout 15 python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
case $gpus in '' | *[!0-9]*) gpus=0 ;; esac
echo "GPUs visible: $gpus" | tee -a "$summary"

step gpu-tests 150 python -m pytest tests/test_gpu.py -q -rA -p no:cacheprovider --timeout 130
step distfn-test-gpu 40 python -m distfn test --gpu
step gpu-hang 125 python bench/bench_gpu.py --gpu --only hang --json "$out/gpu-hang.json"
step gpu-save 55 python bench/bench_gpu.py --gpu --only save --gib 1 --rounds 3 --budget 20 --json "$out/gpu-save.json"
if [ "$gpus" -ge 2 ]; then
    step bench-step 100 python bench/bench_step.py --gpu --rounds 2 --steps 60 --warmup 15 --json "$out/step.json"
    step gpu-launch 55 python bench/bench_gpu.py --gpu --only launch --rounds 3 --budget 25 \
        --json "$out/gpu-launch.json"
fi
if [ "$gpus" -ge 4 ]; then
    step gpu-mesh 150 env DISTFN_BACKEND=nccl python -m pytest tests/test_mesh.py -q -rA -p no:cacheprovider \
        -k "hsdp_2x2 or tp2_dp2 or reshards_onto"
fi

timeout 15 python bench/bench_gpu.py --summary "$out" || failed=1
echo "results in $out" | tee -a "$summary"
exit "$failed"
