#!/usr/bin/env bash
# Multi-GPU NCCL refit (issue 7): one process per GPU, NVLink multicast left off.
# 4 GPUs: Qwen3-30B-A3B tp=2,pp=2 -> tp=2,dp=2; 8 GPUs: tp=2,pp=2,ep=2 -> tp=4,dp=2; the
# domain size is half the node so the cross-domain path is exercised. Reshard against
# gather-and-broadcast in one run, every destination byte verified, raw NCCL send/recv
# bandwidth measured in the same run. Wheels for packages the image lacks travel in .whl.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -ge 8 ]; then SRC=tp=2,pp=2,ep=2; DST=tp=4,dp=2; DOMAIN=4
elif [ "$GPUS" -ge 4 ]; then SRC=tp=2,pp=2; DST=tp=2,dp=2; DOMAIN=2
else echo "needs >= 4 GPUs, found $GPUS" >&2; exit 2; fi
python3 -m elastic_refit.cli bench --model qwen3-30b-a3b --layers 8 --source "$SRC" --destination "$DST" \
    --domain-size "$DOMAIN" --backend nccl --repeat 5 --json | tee "$OUT/bench_nccl.json"
