#!/usr/bin/env bash
# Everything that needs a GPU, in one command (one device call): the kernel tests compiled for real
# (no interpreter), the GPU-only code paths of the analyses, and the benchmarks whose tables go into
# docs/benchmarks.md. Writes logs and JSON to ${OUT:-gpu-results}/.
#
#   bash benchmarks/gpu_suite.sh            # on a CUDA machine with the worker extras installed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/device.txt"

# Tests: kernels compiled on the device, analyses and training with CUDA present (bf16 autocast, cache on GPU).
python -m pytest -q -x tests/kernels tests/analyses tests/modeling 2>&1 | tee "$OUT/tests.log" | tail -5
rc=${PIPESTATUS[0]}  # the benchmarks still run after a test failure, but the suite exits with it

python benchmarks/attention.py --dims 64 128 2>&1 | tee "$OUT/attention.md" | tail -30
python benchmarks/norms.py --model bench-gpt2 --device cuda --samples 512 --json "$OUT/norms.json" 2>&1 \
  | tee "$OUT/norms.log" | tail -20
python benchmarks/entropy.py --device cuda --seq-lens 512,1024,2048,4096 --windows 8 --dtype bfloat16 \
  --json "$OUT/entropy.json" 2>&1 | tee "$OUT/entropy.log" | tail -20

exit "$rc"
