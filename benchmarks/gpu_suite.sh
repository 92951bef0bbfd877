#!/usr/bin/env bash
# Everything that needs a GPU, in as few device calls as fit in their 10-minute limit: the kernel
# tests compiled for real (no interpreter), the GPU-only code paths of the analyses, the benchmarks
# whose tables go into docs/benchmarks.md, and the Fig. 2 sweep's GPU time. Writes logs and JSON
# to ${OUT:-gpu-results}/.
#
#   bash benchmarks/gpu_suite.sh tests      # kernel tests, and the analyses' `gpu`-marked tests, on the GPU
#   bash benchmarks/gpu_suite.sh bench      # attention, FAVOR+/Linformer, norms and entropy benchmarks:
#                                           # bench-kernels (the first two) then bench-jobs (the last two),
#                                           # one device call each where a call has 10 minutes
#   bash benchmarks/gpu_suite.sh bench-jobs-large  # the job benchmarks at the sizes where a GPU's time goes on
#                                           # the model: norms in batches of 64, entropy on a 1B shape
#   bash benchmarks/gpu_suite.sh bench-entropy-job # the whole entropy job on the 1B shape over 64 windows of
#                                           # 4096 tokens, next to sdpa and eager (~2-3 min)
#   bash benchmarks/gpu_suite.sh sweep      # fig2_full.json (200 children) on the GPU, SWEEP_PROCESSES (16)
#   bash benchmarks/gpu_suite.sh all        # all three, one after the other (a machine without
#                                           # the device tool's 10-minute / 8-file limits)
#
# On the device tool, one call per part, each meant to end inside 10 minutes and bring back ≤ 8 files.
# The session has 30 minutes of device time: tests, then the sweep (the run issue #7 waits for), then
# bench-jobs-large, bench-entropy-job, then bench-kernels and bench-jobs with what is left. The sweep runs whole, with its figures: 8 processes
# took 25 s per child (12 min for the grid, past one call), 16 may take half that (the children are
# bound by the host's kernel launches, and the machine has 16 cores); a run the limit stops is
# finished by a second call (SWEEP_RESULTS, below). `SWEEP_LIMIT=40 …` extrapolates instead.
# `SWEEP_DEVICE=cpu` trains the children on the host's cores instead, for comparison.
#
# The GPU image lacks lmscope's light dependencies (pydantic, SQLAlchemy, Flask, Celery, ...):
# `bash benchmarks/gpu_wheels.sh` here downloads them into .whl/; carry .whl and start the device
# command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD LMSCOPE_WIKITEXT2_PATH=$PWD/.whl/wiki.test.raw &&
# (gpu_wheels.sh copies WikiText-2 into .whl/ too: the tests and the job benchmarks read it).
# Each part's steps stop at a limit: ANALYSES_TIMEOUT, KERNELS_TIMEOUT (s) for the tests, BENCH_TIMEOUT
# for each benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
PART="${1:-all}"
PY="${PYTHON:-python3}"  # the GPU image has python3 (a venv), not necessarily `python`
case "$PART" in
  tests|bench|bench-kernels|bench-jobs|bench-jobs-large|bench-entropy-job|sweep|all) ;;
  *) echo "unknown part '$PART': give tests, bench (or bench-kernels, bench-jobs, bench-jobs-large, bench-entropy-job)," \
       "sweep or all" >&2
     exit 2 ;;
esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
rc=0
# Every step runs even after one fails; the suite exits non-zero if any did.
step_failed() { local status=$1; (( status != 0 )) && rc=$status; return 0; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  # the carried wheels against the image's packages: a failure here would fail every test at collection
  "$PY" -c "import lmscope.api, lmscope.up, lmscope.analyses.registry; print('lmscope imports: ok')"
  "$PY" -c "from lmscope.config import Settings; print('wikitext-2:', Settings.from_env().wikitext2_path)"
} 2>&1 | tee "$OUT/device.txt"
if ! grep -q "lmscope imports: ok" "$OUT/device.txt"; then
  echo "lmscope does not import on this image (see $OUT/device.txt): fix the wheels first" >&2
  exit 3
fi

if [[ "$PART" == tests || "$PART" == all ]]; then
  # The analyses' tests marked `gpu` first (the only run of the jobs' CUDA paths: kernel routes on the
  # device, jobs through the embedded worker, training under bf16 autocast), then the kernels compiled on
  # the device (not the sm_90 compile check, marked slow: here the kernels really launch). The rest of
  # tests/analyses runs on the CPU whatever the machine, so CI covers it. LMSCOPE_AUTOTUNE=0: correctness
  # needs one tile per shape, and tuning every candidate for ~70 test shapes would take most of the call
  # (the benchmarks tune). No -x: one failure must not hide the others. `timeout -s INT` stops a run that
  # would outlast the call the way Ctrl-C does, so pytest still prints its failures (-rfE, short tracebacks).
  # Compiling ~70 test shapes is most of the kernels' time: pytest-xdist (in the GPU image) spreads it
  # over the machine's cores; the launches share the one GPU.
  xdist=()
  "$PY" -c "import xdist" 2>/dev/null && xdist=(-n "${PYTEST_WORKERS:-8}")
  LMSCOPE_AUTOTUNE=0 timeout -s INT "${ANALYSES_TIMEOUT:-240}" "$PY" -m pytest -q -rfE --tb=short --durations=10 \
    "${xdist[@]}" -m gpu tests/analyses 2>&1 | tee "$OUT/tests.log" | tail -25
  step_failed "${PIPESTATUS[0]}"
  LMSCOPE_AUTOTUNE=0 timeout -s INT "${KERNELS_TIMEOUT:-300}" "$PY" -m pytest -q -rfE --tb=short --durations=15 \
    "${xdist[@]}" -m "not slow" tests/kernels 2>&1 | tee -a "$OUT/tests.log" | tail -25
  step_failed "${PIPESTATUS[0]}"
fi

if [[ "$PART" == bench || "$PART" == bench-kernels || "$PART" == all ]]; then
  timeout -s INT "${BENCH_TIMEOUT:-590}" "$PY" benchmarks/attention.py --dims 64 128 2>&1 | tee "$OUT/attention.md" | tail -30
  step_failed "${PIPESTATUS[0]}"
  timeout -s INT "${BENCH_TIMEOUT:-590}" "$PY" benchmarks/approximations.py 2>&1 | tee "$OUT/approximations.md" | tail -12
  step_failed "${PIPESTATUS[0]}"
fi

if [[ "$PART" == bench || "$PART" == bench-jobs || "$PART" == all ]]; then
  timeout -s INT "${BENCH_TIMEOUT:-590}" "$PY" benchmarks/norms.py --model bench-gpt2 --device cuda --dtype bfloat16 --samples 512 --json "$OUT/norms.json" 2>&1 \
    | tee "$OUT/norms.log" | tail -20
  step_failed "${PIPESTATUS[0]}"
  # the longest-seq_len search stops at 32768 (the issue's length) or at a 30-s run, to fit the call
  timeout -s INT "${BENCH_TIMEOUT:-590}" "$PY" benchmarks/entropy.py --device cuda --seq-lens 512,1024,2048,4096 --windows 8 --dtype bfloat16 \
    --max-seq-len 32768 --time-limit 30 --json "$OUT/entropy.json" 2>&1 | tee "$OUT/entropy.log" | tail -20
  step_failed "${PIPESTATUS[0]}"
fi

if [[ "$PART" == bench-jobs-large || "$PART" == all ]]; then
  # batches of 16 × 256 tokens leave an H100 waiting for the host; 64 samples per batch keep it busy
  timeout -s INT "${BENCH_TIMEOUT:-590}" "$PY" benchmarks/norms.py --model bench-gpt2 --device cuda --dtype bfloat16 --samples 2048 \
    --batch-size 64 --gram-samples 0 --json "$OUT/norms_b64.json" 2>&1 | tee "$OUT/norms_b64.log" | tail -20
  step_failed "${PIPESTATUS[0]}"
  # a model the size of LLaMA-3.2-1B, where the GPU's time goes on the model rather than on launches
  timeout -s INT "${BENCH_TIMEOUT:-590}" "$PY" benchmarks/entropy.py --model bench-llama-1b --device cuda --seq-lens 1024,4096 \
    --windows 16 --batch-size 4 --dtype bfloat16 --skip-longest --json "$OUT/entropy_1b.json" 2>&1 | tee "$OUT/entropy_1b.log" | tail -12
  step_failed "${PIPESTATUS[0]}"
fi

if [[ "$PART" == bench-entropy-job || "$PART" == all ]]; then
  # a job of the size researchers submit (64 windows of 4096 tokens, where 8 leave the job's fixed costs of
  # statistics and plots in the ratio): the whole job against sdpa and against the eager route, batch 1
  timeout -s INT "${BENCH_TIMEOUT:-590}" "$PY" benchmarks/entropy.py --model bench-llama-1b --device cuda --seq-lens 4096 \
    --windows 64 --batch-size 1 --repeats 1 --dtype bfloat16 --skip-longest --json "$OUT/entropy_1b_w64.json" 2>&1 \
    | tee "$OUT/entropy_1b_w64.log" | tail -8
  step_failed "${PIPESTATUS[0]}"
fi

if [[ "$PART" == sweep || "$PART" == all ]]; then
  # The whole Fig. 2 grid if it fits the call; `--limit 40` gives an extrapolation in a quarter of the time.
  # The children's own plots stay in /tmp: the device call brings back at most 8 files.
  # Each finished child is appended to SWEEP_RESULTS: a run stopped by the time limit is finished by
  # another call given that file (carried back from the first call's $OUT, or left in /tmp on a warm
  # machine). SWEEP_TIMEOUT leaves the children running at the limit time to end within the call.
  results="${SWEEP_RESULTS:-/tmp/lmscope-sweep/children.jsonl}"
  rm -f /tmp/lmscope-sweep/*.png  # a warm machine keeps the last call's figures
  mkdir -p "$(dirname "$results")"
  timeout -s INT "${SWEEP_TIMEOUT:-540}" "$PY" benchmarks/sweep.py --device "${SWEEP_DEVICE:-cuda}" \
    --processes "${SWEEP_PROCESSES:-16}" ${SWEEP_LIMIT:+--limit "$SWEEP_LIMIT"} --results "$results" \
    --out /tmp/lmscope-sweep --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | tail -8
  step_failed "${PIPESTATUS[0]}"
  cp /tmp/lmscope-sweep/fig*.png "$OUT/" 2>/dev/null
  cp "$results" "$OUT/sweep_children.jsonl" 2>/dev/null
fi

exit "$rc"
