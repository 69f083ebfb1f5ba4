#!/usr/bin/env bash
# Where a one-process (TP1) `ckptctl update`'s "start" stage goes, on a GPU node: a TP1
# stand-in receiver on GPU 0, then one update in each register mode, with every thread's
# stack sampled every 0.1 s (bench/stack_sampler). From the repository root:
#     . tests/support/gpu_kit.sh || exit 1; bash bench/probe_tp1_start.sh OUTDIR
# Findings: bench/results/start-stage-tp1.md.
set -uo pipefail
out=${1:?usage: probe_tp1_start.sh OUTDIR}
mkdir -p "$out"
ck=/tmp/smoke-ckpt
python3 tests/support/gpu_smoke_ps.py write "$ck" >/dev/null || exit 1
python3 tests/support/gpu_receiver.py --checkpoint-path "$ck" --devices 0 --port 31001 >"$out/rx.log" 2>&1 &
rx=$!
for _ in $(seq 1 120); do grep -q '^READY ' "$out/rx.log" && break; sleep 0.5; done
for mode in engine direct; do
    STACK_SAMPLES=$out/stacks-$mode PYTHONPATH=$PWD/bench/stack_sampler:${PYTHONPATH:-} \
        timeout 60 python3 -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 \
        --master-port $((29900 + RANDOM % 50 * 2)) --no-python ckptctl update \
        --checkpoint-path "$ck" --inference-parallel-size 1 --endpoint http://127.0.0.1:31001 \
        --register-mode "$mode" >"$out/$mode.json" 2>"$out/$mode.err"
    echo "$mode rc=$?"
    grep -E "start:|pin" "$out/$mode.err" | head -3
done
kill "$rx"
wait "$rx" 2>/dev/null
