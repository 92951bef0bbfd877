#!/usr/bin/env bash
# Everything that needs a GPU: the kernel tests compiled for real (no interpreter), the GPU-only code paths
# of the analyses, the benchmarks whose tables go into docs/benchmarks.md, and the Fig. 2 sweep's GPU time.
# Writes logs and JSON to ${OUT:-gpu-results}/.
#
#   bash benchmarks/gpu_suite.sh session    # THE ONE DEVICE CALL of a GPU session (its device time is 15 minutes,
#                                           # the machine's start included): every step below, most wanted
#                                           # first, inside SUITE_SECONDS (540) all together; a step that would
#                                           # not fit is skipped and named. Brings back ≤ 8 files (see below).
#   bash benchmarks/gpu_suite.sh tests      # kernel tests, and the analyses' `gpu`-marked tests, on the GPU
#   bash benchmarks/gpu_suite.sh bench      # attention, FAVOR+/Linformer, norms, pruning, operator and entropy benchmarks
#                                           # (bench-kernels: the first two and the sweep children's CUDA-graph
#                                           # steps; bench-jobs: norms, pruning, operator and entropy)
#   bash benchmarks/gpu_suite.sh bench-jobs-large  # the job benchmarks at the sizes where a GPU's time goes on
#                                           # the model: norms in batches of 64, entropy on a 1B shape
#   bash benchmarks/gpu_suite.sh bench-entropy-job # the whole entropy job on the 1B shape over 64 windows of
#                                           # 4096 tokens, next to sdpa and eager (~2-3 min)
#   bash benchmarks/gpu_suite.sh sweep      # fig2_full.json (200 children) on the GPU, SWEEP_PROCESSES (16)
#   bash benchmarks/gpu_suite.sh all        # all of the parts above but session, one after the other
#
# `session`, in order: the sweep children's CUDA-graph steps against eager ones (their tests, then
# benchmarks/sumformer_steps.py), the whole Fig. 2 sweep (issue #7; resumable, see SWEEP_RESULTS), the
# analyses' `gpu` tests, the kernel tests, then the attention kernel at N = 4096 and 16384 (#3), the norms
# job (#5) and the entropy job on the 1B shape (#6); the sweep and the kernel tests may leave the last ones no
# time (they are then named as skipped). On the device tool, give it timeout_s = SUITE_SECONDS + 60 (the last
# step's kill grace and the packing; the wheels' install counts inside SUITE_SECONDS); what it brings back: device.txt, session.log
# (every step's output), results.tgz (every JSON and log), sweep_children.jsonl (give it back as
# SWEEP_RESULTS to a second call, which then trains only the children still missing) and the sweep's
# figure. A second call (if the session's time allows one) can run whatever the first skipped, by part.
#
# The GPU image lacks lmscope's light dependencies (pydantic, SQLAlchemy, Flask, Celery, ...):
# `bash benchmarks/gpu_wheels.sh` here downloads them into .whl/; carry .whl and start the device
# command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD LMSCOPE_WIKITEXT2_PATH=$PWD/.whl/wiki.test.raw &&
# (gpu_wheels.sh copies WikiText-2 into .whl/ too: the tests and the job benchmarks read it).
# Each step stops at its own limit (ANALYSES_TIMEOUT, KERNELS_TIMEOUT, BENCH_TIMEOUT, SWEEP_TIMEOUT, in
# seconds), and under `session` also at what is left of SUITE_SECONDS (SUITE_SECONDS=0: no overall limit).
# `timeout -s INT` stops a step the way Ctrl-C does, so pytest still prints its failures and a benchmark
# keeps the rows it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
PART="${1:-all}"
PY="${PYTHON:-python3}"  # the GPU image has python3 (a venv), not necessarily `python`
case "$PART" in
  session|tests|bench|bench-kernels|bench-jobs|bench-jobs-large|bench-entropy-job|sweep|all) ;;
  *) echo "unknown part '$PART': give session, tests, bench (or bench-kernels, bench-jobs, bench-jobs-large," \
       "bench-entropy-job), sweep or all" >&2
     exit 2 ;;
esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
rc=0
skipped=()
BUDGET=0
[[ "$PART" == session ]] && BUDGET="${SUITE_SECONDS:-540}"
# Under `session`, the JSON files and the per-step logs go to WORK and come back packed in one file (the device
# tool brings back at most 8); otherwise each part writes them to OUT as before.
WORK="$OUT"
LOG="$OUT/suite.log"  # what ran, what failed, what was skipped (under session, every step's output as well)
if [[ "$PART" == session ]]; then
  LOG="$OUT/session.log"
  WORK="${SUITE_WORK:-/tmp/lmscope-suite}"
  rm -rf "$WORK" && mkdir -p "$WORK"
  pack() { tar czf "$OUT/results.tgz" -C "$WORK" . 2>/dev/null; }
  trap pack EXIT
fi

# step NAME CAP LOG TAIL COMMAND...: run COMMAND under `timeout -s INT`, at most CAP seconds, or what is
# left of the session's budget (less a reserve for packing) when that is shorter; a step with less than
# MIN_STEP_SECONDS left is skipped and named. Output goes to WORK/LOG (and session.log), its last TAIL lines
# to the terminal. Every step runs even after one fails; the suite exits non-zero if any did.
step() {
  local name=$1 cap=$2 log=$3 lines=$4
  shift 4
  local limit=$cap
  if (( BUDGET > 0 )); then
    local left=$(( BUDGET - SECONDS - ${SUITE_RESERVE:-30} ))
    if (( left < ${MIN_STEP_SECONDS:-30} )); then
      echo "== $name: skipped (${left}s of SUITE_SECONDS=$BUDGET left)" | tee -a "$LOG"
      skipped+=("$name")
      return 0
    fi
    (( left < limit )) && limit=$left
  fi
  echo "== $name (at ${SECONDS}s, limit ${limit}s)" | tee -a "$WORK/$log" "$LOG"
  # -k: a step that does not end within 20 s of its SIGINT is killed (the budget must hold)
  if [[ "$PART" == session ]]; then
    timeout -k 20 -s INT "$limit" "$@" 2>&1 | tee -a "$WORK/$log" | tee -a "$LOG" | tail -n "$lines"
  else
    timeout -k 20 -s INT "$limit" "$@" 2>&1 | tee -a "$WORK/$log" | tail -n "$lines"
  fi
  local status=${PIPESTATUS[0]}
  (( status != 0 )) && rc=$status && echo "== $name: exit $status" | tee -a "$LOG" >/dev/null
  [[ "$PART" == session ]] && pack  # what has finished comes back even if the call is cut short
  return 0
}
SECONDS=0

# The wheels of gpu_wheels.sh, when carried as .whl and not yet installed: the device call can then be
# just `bash benchmarks/gpu_suite.sh session`.
if [[ -d .whl ]] && ! "$PY" -c "import pydantic, sqlalchemy, flask, celery" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -f .whl/wiki.test.raw && -z "${LMSCOPE_WIKITEXT2_PATH:-}" ]]; then
  export LMSCOPE_WIKITEXT2_PATH="$PWD/.whl/wiki.test.raw"  # ../shared does not travel to the device
fi

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

# LMSCOPE_AUTOTUNE=0 in the tests: correctness needs one tile per shape, and tuning every candidate for ~70
# test shapes would take most of a call (the benchmarks tune). No -x: one failure must not hide the others.
# Compiling the test shapes is most of the kernels' time: pytest-xdist (in the GPU image) spreads it over
# the machine's cores; the launches share the one GPU.
xdist=()
workers="${PYTEST_WORKERS:-8}"
[[ "$PART" == session ]] && workers="${PYTEST_WORKERS:-12}"  # the H200's 16 cores, less the sweep's leftovers
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n "$workers")
pytest_gpu=(env LMSCOPE_AUTOTUNE=0 "$PY" -m pytest -q -rfE --tb=short -p no:cacheprovider)  # a command, for timeout

GRAPH_TESTS="cuda_graph or captured or failed_capture"  # the sweep children's CUDA-graph tests (test_sweep.py)
cuda_graph_tests() {
  step cuda-graph-tests "${ANALYSES_TIMEOUT:-240}" tests.log 8 "${pytest_gpu[@]}" -m gpu tests/analyses/test_sweep.py \
    -k "$GRAPH_TESTS"
}

sumformer_steps() {  # the sweep children's CUDA-graph steps against eager ones, timed
  step sumformer-steps "${BENCH_TIMEOUT:-590}" sumformer_steps.md 9 "$PY" benchmarks/sumformer_steps.py \
    --epochs "${STEPS_EPOCHS:-200}" --json "$WORK/sumformer_steps.json"
}

analyses_tests() {  # the only run of the jobs' CUDA paths: kernel routes on the device, jobs through the
  # embedded worker, training under bf16 autocast (the rest of tests/analyses runs on the CPU, so CI covers it).
  # ARGS: more pytest arguments (the session's: leave out the CUDA-graph tests it ran first)
  step analyses-tests "${ANALYSES_TIMEOUT:-240}" tests.log 25 "${pytest_gpu[@]}" --durations=10 "${xdist[@]}" -m gpu \
    "$@" tests/analyses
}

kernel_tests() {  # the kernels compiled on the device (not the sm_90 compile check, marked slow: here they launch)
  step kernel-tests "${KERNELS_TIMEOUT:-300}" tests.log 25 "${pytest_gpu[@]}" --durations=15 "${xdist[@]}" -m "not slow" tests/kernels
}

sweep() {
  # The whole Fig. 2 grid (SWEEP_LIMIT=40 extrapolates from 40 children instead). The children's own plots
  # stay in /tmp. Each finished child is appended to SWEEP_RESULTS: a run stopped by its time limit is finished
  # by another call given that file (carried back from the first call's $OUT, or left in /tmp on a warm machine).
  local results="${SWEEP_RESULTS:-/tmp/lmscope-sweep/children.jsonl}" figures="${SWEEP_OUT:-/tmp/lmscope-sweep}"
  rm -f "$figures"/*.png  # a warm machine keeps the last call's figures
  mkdir -p "$(dirname "$results")"
  step sweep "${SWEEP_TIMEOUT:-540}" sweep.log 8 "$PY" benchmarks/sweep.py --device "${SWEEP_DEVICE:-cuda}" \
    --processes "${SWEEP_PROCESSES:-16}" ${SWEEP_LIMIT:+--limit "$SWEEP_LIMIT"} --results "$results" \
    --out "$figures" --json "$WORK/sweep.json"
  cp "$figures"/fig*.png "$OUT/" 2>/dev/null
  cp "$results" "$OUT/sweep_children.jsonl" 2>/dev/null
  return 0
}

bench_attention() {  # ARGS: extra arguments (the session's: two lengths, no options table)
  step bench-attention "${BENCH_TIMEOUT:-590}" attention.md 30 "$PY" benchmarks/attention.py --dims 64 128 "$@"
}

bench_norms() {
  step bench-norms "${BENCH_TIMEOUT:-590}" norms.log 20 "$PY" benchmarks/norms.py --model bench-gpt2 --device cuda \
    --dtype bfloat16 --samples 512 --json "$WORK/norms.json"
}

bench_pruning() {  # the job's hooks against plain forwards, on a GPT-2-small-sized LLaMA (GQA)
  step bench-pruning "${BENCH_TIMEOUT:-590}" pruning.log 12 "$PY" benchmarks/pruning.py --model bench-llama \
    --dtype bfloat16 --seq-len 512 --windows 16 --json "$WORK/pruning.json"
}

bench_operator() {  # the job's eager attention and replacements against plain (sdpa) forwards, GPT-2-small-sized LLaMA
  step bench-operator "${BENCH_TIMEOUT:-590}" operator.log 12 "$PY" benchmarks/operator.py --model bench-llama \
    --dtype bfloat16 --seq-len 512 --windows 16 --json "$WORK/operator.json"
}

bench_entropy_1b() {  # a model the size of LLaMA-3.2-1B, where the GPU's time goes on the model, not on launches
  step bench-entropy-1b "${BENCH_TIMEOUT:-590}" entropy_1b.log 12 "$PY" benchmarks/entropy.py --model bench-llama-1b \
    --device cuda --seq-lens 1024,4096 --windows 16 --batch-size 4 --dtype bfloat16 --skip-longest \
    --json "$WORK/entropy_1b.json"
}

case "$PART" in
  session)
    ANALYSES_TIMEOUT="${ANALYSES_TIMEOUT:-90}" cuda_graph_tests
    STEPS_EPOCHS="${STEPS_EPOCHS:-60}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}" sumformer_steps
    SWEEP_TIMEOUT="${SWEEP_TIMEOUT:-150}" sweep  # resumable: a second call trains what is left
    ANALYSES_TIMEOUT="${ANALYSES_TIMEOUT:-150}" analyses_tests -k "not ($GRAPH_TESTS)"
    KERNELS_TIMEOUT="${KERNELS_TIMEOUT:-240}" kernel_tests
    BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}" bench_attention --ns 4096 16384 --no-options
    BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}" bench_norms
    BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}" bench_entropy_1b
    ;;
esac

if [[ "$PART" == tests || "$PART" == all ]]; then
  analyses_tests
  kernel_tests
fi

if [[ "$PART" == bench || "$PART" == bench-kernels || "$PART" == all ]]; then
  bench_attention
  step bench-approximations "${BENCH_TIMEOUT:-590}" approximations.md 12 "$PY" benchmarks/approximations.py
  sumformer_steps
fi

if [[ "$PART" == bench || "$PART" == bench-jobs || "$PART" == all ]]; then
  bench_norms
  bench_pruning
  bench_operator
  # the longest-seq_len search stops at 32768 (the issue's length) or at a 30-s run, to fit the call
  step bench-entropy "${BENCH_TIMEOUT:-590}" entropy.log 20 "$PY" benchmarks/entropy.py --device cuda \
    --seq-lens 512,1024,2048,4096 --windows 8 --dtype bfloat16 --max-seq-len 32768 --time-limit 30 \
    --json "$WORK/entropy.json"
fi

if [[ "$PART" == bench-jobs-large || "$PART" == all ]]; then
  # batches of 16 × 256 tokens leave an H100 waiting for the host; 64 samples per batch keep it busy
  step bench-norms-b64 "${BENCH_TIMEOUT:-590}" norms_b64.log 20 "$PY" benchmarks/norms.py --model bench-gpt2 \
    --device cuda --dtype bfloat16 --samples 2048 --batch-size 64 --gram-samples 0 --json "$WORK/norms_b64.json"
  bench_entropy_1b
fi

if [[ "$PART" == bench-entropy-job || "$PART" == all ]]; then
  # a job of the size researchers submit (64 windows of 4096 tokens, where 8 leave the job's fixed costs of
  # statistics and plots in the ratio): the whole job against sdpa and against the eager route, batch 1
  step bench-entropy-job "${BENCH_TIMEOUT:-590}" entropy_1b_w64.log 8 "$PY" benchmarks/entropy.py \
    --model bench-llama-1b --device cuda --seq-lens 4096 --windows 64 --batch-size 1 --repeats 1 --dtype bfloat16 \
    --skip-longest --json "$WORK/entropy_1b_w64.json"
fi

if [[ "$PART" == sweep || "$PART" == all ]]; then
  sweep
fi

if (( ${#skipped[@]} > 0 )); then
  echo "skipped for time: ${skipped[*]} (run them in a second call, by part)" | tee -a "$LOG"
fi
echo "suite: ${SECONDS}s, exit $rc" | tee -a "$LOG" >/dev/null
exit "$rc"
