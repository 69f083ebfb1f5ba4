#!/bin/bash
# One GPU: where a serve push's time goes, by bucket size (bench/bench_push.py), for Qwen3-8B
# shapes and the DeepSeek-V3 layout, with the seed script side by side when .seed/update.py is
# carried. Checkpoints in /dev/shm (written in seconds, read as from a warm page cache), deleted
# at the end; each push's trace copied to OUT/traces/.
#     . tests/support/gpu_kit.sh || exit 1; bash bench/push_session.sh OUT [8B_SIZES] [DSV3_SIZES] [DSV3_PUSHES]
# (8B_SIZES "-": the DeepSeek-V3 layout only. PUSH_EXTRA: more bench_push.py flags for both,
# e.g. PUSH_EXTRA=--stage: each bucket size also with every push read ahead by `ckptctl stage`.)
set -u
out=$1
sizes_8b=${2:-8,2,1}
sizes_dsv3=${3:-8,1}
work=/dev/shm/ckptctl-bench-push
mkdir -p "$out/traces" "$work"
seed=()
if [ -f .seed/update.py ]; then seed=(--seed-script .seed/update.py); fi
if [ "$sizes_8b" != "-" ]; then
echo "== qwen3-8b $(date -u +%H:%M:%S)"
timeout 300 python3 bench/bench_push.py --model qwen3-8b --bucket-sizes "$sizes_8b" --pushes 4 \
    "${seed[@]}" ${PUSH_EXTRA:-} --workdir "$work" --out "$out" > "$out/qwen3-8b.log" 2>&1
tail -5 "$out/qwen3-8b.log"
mkdir -p "$out/traces/qwen3-8b" && cp $(ls -t "$work"/push-*.json | head -2) "$out/traces/qwen3-8b/" 2>/dev/null
rm -rf "$work"/*
fi
echo "== deepseek-v3-small $(date -u +%H:%M:%S)"
timeout 170 python3 bench/bench_push.py --model deepseek-v3-small --bucket-sizes "$sizes_dsv3" \
    --pushes "${4:-3}" "${seed[@]}" ${PUSH_EXTRA:-} --workdir "$work" --out "$out" > "$out/dsv3.log" 2>&1
tail -5 "$out/dsv3.log"
mkdir -p "$out/traces/dsv3" && cp $(ls -t "$work"/push-*.json | head -2) "$out/traces/dsv3/" 2>/dev/null
rm -rf "$work"
echo "== done $(date -u +%H:%M:%S)"
