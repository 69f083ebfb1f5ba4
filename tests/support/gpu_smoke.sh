#!/usr/bin/env bash
# The device smoke test of the GPU receiver (tests/gpu/README.md). From the repository root:
#     bash tests/support/gpu_smoke.sh OUTDIR [--pytest]
# 1. writes a small mixed-dtype checkpoint;
# 2. starts tests/support/gpu_receiver.py (SGLang 0.5.23 profile, TCP) on GPU 0 and drives it with
#    checkpoint-engine's ParameterServer under torchrun: ok, fail_last, fail_mid, ok;
# 3. the same against a vLLM-profile receiver on a Unix socket: ok, fail_last;
# 4. with --pytest, also `pytest -m gpu tests/gpu/test_gpu_receiver_gpu.py`.
set -uo pipefail
out=${1:?usage: gpu_smoke.sh OUTDIR [--pytest]}
mkdir -p "$out"
. tests/support/gpu_kit.sh || exit 1
ck=/tmp/smoke-ckpt
status=0

python3 tests/support/gpu_smoke_ps.py write "$ck" || exit 1

# start_receiver LOG ARGS... : start it in the background, wait (bounded) for its READY line
start_receiver() {
    local log=$1; shift
    python3 tests/support/gpu_receiver.py --checkpoint-path "$ck" --devices 0 "$@" >"$log" 2>&1 &
    rx_pid=$!
    for _ in $(seq 1 240); do
        grep -q '^READY ' "$log" && { grep '^READY ' "$log"; return 0; }
        kill -0 "$rx_pid" 2>/dev/null || break
        sleep 0.5
    done
    echo "receiver did not get ready:"; tail -20 "$log"; return 1
}
stop_receiver() { kill "$rx_pid" 2>/dev/null; wait "$rx_pid" 2>/dev/null; }

drive() {  # drive NAME ARGS... : one torchrun, bounded
    local name=$1; shift
    timeout -k 5 150 python3 -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29611 \
        tests/support/gpu_smoke_ps.py drive --checkpoint "$ck" --out "$out/smoke_$name.json" "$@" \
        >"$out/torchrun_$name.log" 2>&1
    local rc=$?
    grep -E '^(ROUND|SMOKE)' "$out/torchrun_$name.log"
    [ $rc -eq 0 ] || { echo "torchrun ($name) exit $rc"; tail -30 "$out/torchrun_$name.log"; }
    return $rc
}

t0=$(date +%s.%N)
if start_receiver "$out/receiver_sglang.log" --port 31001 --profile sglang-0.5.23; then
    drive sglang --endpoint http://127.0.0.1:31001 --engine sglang \
        --rounds ok,fail_last,fail_mid,ok || status=1
    stop_receiver
else status=1; fi
echo "sglang smoke: $(python3 -c "import time;print(round(time.time()-$t0,1))") s"

t0=$(date +%s.%N)
if start_receiver "$out/receiver_vllm.log" --uds /tmp/rx-vllm.sock --profile vllm; then
    drive vllm --uds /tmp/rx-vllm.sock --engine vllm --rounds ok,fail_last || status=1
    stop_receiver
else status=1; fi
echo "vllm smoke: $(python3 -c "import time;print(round(time.time()-$t0,1))") s"

if [ "${2:-}" = "--pytest" ]; then
    timeout -k 5 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_receiver_gpu.py \
        >"$out/pytest_gpu.log" 2>&1 || status=1
    tail -15 "$out/pytest_gpu.log"
fi
echo "gpu_smoke.sh: exit $status"
exit $status
