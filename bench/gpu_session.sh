#!/usr/bin/env bash
# What a GPU session checks, in two device calls (each under the 10-minute limit, 2x H200):
#     . tests/gpu_kit.sh && bash bench/gpu_session.sh tests "$OUT"   # about 9 minutes
#     . tests/gpu_kit.sh && bash bench/gpu_session.sh bench "$OUT"   # about 4 minutes
# tests: the GPU test suite (bit-exact receivers, failure cases with exit codes and timings).
# bench: the update benchmark, Qwen3-8B shapes, TP2, checkpoint-engine's registration and ours
#        ("direct") side by side, with the machine's limits measured in the same run.
# Results land in the folder given (default bench/results/latest): pytest.log,
# gpu_tests.jsonl, update-qwen3-8b-tp2.{json,md}. Commit what is worth keeping.
set -uo pipefail
what=${1:-tests}
out=${2:-bench/results/latest}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CKPTCTL_GPU_RESULTS="$out"

case "$what" in
tests)
    timeout 570 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --timeout 200 -rf \
        2>&1 | tee "$out/pytest.log" | grep -E "passed|failed|^FAILED"
    ;;
bench)
    timeout 570 python3 bench/bench_update.py --model qwen3-8b --tp 2 --runs 2 \
        --register-modes engine,direct --out "$out" 2>&1 | tail -20
    ;;
*)
    echo "usage: bench/gpu_session.sh tests|bench [OUT]" >&2
    exit 2
    ;;
esac
