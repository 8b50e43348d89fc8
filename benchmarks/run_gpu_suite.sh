#!/usr/bin/env bash
# One batched device run: GPU tests, then the single-GPU refit benchmark and the kernel
# benchmark; logs and JSON land in $OUT. Wheels for packages the GPU image lacks travel
# in .whl (see README of the device tool).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 benchmarks/bench_gpu_local.py --model qwen3-30b-a3b --layers 8 --source tp=2,pp=2,ep=2 \
    --destination tp=2,dp=2 --repeat 5 --json > "$OUT/bench_gpu_local.json" 2> "$OUT/bench_gpu_local.err"
cat "$OUT/bench_gpu_local.json"; tail -3 "$OUT/bench_gpu_local.err"
