# Source this first in every device command, from the repository root:
#     . tests/support/gpu_kit.sh || exit 1
# It installs the carried wheels (.whl/, see tests/gpu/README.md) into /tmp/site, puts them and
# the repository on PYTHONPATH, puts a `ckptctl` wrapper on PATH and keeps NVLink multicast off.
# Works under bash and sh (dash); safe to source twice.

ckpt_repo=$(pwd)
if [ ! -f "$ckpt_repo/tests/support/gpu_kit.sh" ]; then
    echo "gpu_kit.sh: source me from the repository root (no tests/support/gpu_kit.sh in $ckpt_repo)" >&2
    return 1 2>/dev/null || exit 1
fi

# NVLink multicast can put a shared host's GPUs out of service: never turn it on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

if ls "$ckpt_repo"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$ckpt_repo"/.whl/*.whl || { echo "gpu_kit.sh: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
else
    echo "gpu_kit.sh: no .whl/ here - did the call carry it? (tests/gpu/README.md)" >&2
fi
export PYTHONPATH="/tmp/site:$ckpt_repo${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p /tmp/ckptctl-bin
printf '#!/bin/sh\nexec python3 -m ckptctl "$@"\n' > /tmp/ckptctl-bin/ckptctl
chmod +x /tmp/ckptctl-bin/ckptctl
case ":$PATH:" in *:/tmp/ckptctl-bin:*) ;; *) export PATH="/tmp/ckptctl-bin:$PATH" ;; esac

python3 - <<'PY' || { echo "gpu_kit.sh: imports failed" >&2; return 1 2>/dev/null || exit 1; }
import importlib.metadata as md, torch, checkpoint_engine.ps, checkpoint_engine.worker, ckptctl
print(f"gpu_kit: python {__import__('sys').version.split()[0]}, torch {torch.__version__}, "
      f"{torch.cuda.device_count()} GPU(s), checkpoint-engine {md.version('checkpoint-engine')}, "
      f"typer {md.version('typer')}, ckptctl {ckptctl.__version__}")
PY
unset ckpt_repo
