#!/bin/bash
# One GPU: serve pushes of Qwen3-8B shapes (TP1) with the read overlapping the
# transfer (this tree) and without (BEFORE: a tree of the commit before it), in one run, with
# the machine's host-to-device and page-cache read limits measured in the same run.
#     . tests/support/gpu_kit.sh || exit 1; bash bench/serve_overlap_session.sh OUT BEFORE_TREE [PUSHES]
# OUT gets limits.json, after/ and before/ (bench_serve.py's results and job logs); the
# checkpoints (2 x 16.4 GB under /tmp/ckptctl-bench) are deleted at the end.
set -u
out=$1
before=$(cd "$2" && pwd)
pushes=${3:-6}
after=$(pwd)
work=/tmp/ckptctl-bench
mkdir -p "$out/after" "$out/before" "$work"
site=${PYTHONPATH%%:*}  # /tmp/site, where gpu_kit.sh put the wheels

echo "== checkpoints and limits $(date -u +%H:%M:%S)"
python3 - "$work" "$out/limits.json" <<'PY' || exit 1
import json, sys, time
from pathlib import Path
sys.path[:0] = ["bench"]
from _support.ckpt_factory import write_checkpoint
from _support.limits import h2d_bandwidth, limit_read
work, dest = Path(sys.argv[1]), Path(sys.argv[2])
t0 = time.perf_counter()
for name, seed in (("qwen3-8b", 20261129), ("qwen3-8b-serve-1", 1001)):
    if not (work / name / "model.safetensors.index.json").exists():
        write_checkpoint(work / name, "qwen3-8b", seed=seed)
written = time.perf_counter() - t0
files = sorted((work / "qwen3-8b").glob("*.safetensors"))
for _ in range(2):  # warm: every page in the cache
    limit_read(files, 16, fresh=False)
doc = {
    "h2d_pinned_gb_s": round(h2d_bandwidth(True), 2),
    "h2d_pageable_gb_s": round(h2d_bandwidth(False), 2),
    "warm_read_gb_s_16_threads": round(limit_read(files, 16, fresh=False), 2),
    "warm_read_gb_s_16_threads_into_fresh_memory": round(limit_read(files, 16, fresh=True), 2),
    "checkpoint_bytes": sum(f.stat().st_size for f in files),
    "write_s": round(written, 1),
}
dest.write_text(json.dumps(doc, indent=1) + "\n")
print(doc)
PY

bench() {  # TREE OUT_DIR
    echo "== $1 $(date -u +%H:%M:%S)"
    (cd "$1" && PYTHONPATH="$site:$1" python3 bench/bench_serve.py --model qwen3-8b --tp 1 \
        --pushes 1 --api-pushes "$pushes" --consume-pushes 0 --keep \
        --workdir "$work" --out "$2" 2>&1 | grep -E "^push|refused|Median|failed|Error" )
}
bench "$after" "$out/after"
bench "$before" "$out/before"
echo "== done $(date -u +%H:%M:%S)"
rm -rf "$work"
