"""Backend choice, its environment override, and the light import of lmscope.kernels."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmscope.kernels import attention_with_entropy, dimension_entropy, dispatch, kernel_backend
from tests.conftest import need_module
from tests.kernels.conftest import TRITON_OK

ROOT = Path(__file__).resolve().parents[2]


def test_offsets_inside_a_head_fit_32_bits():
    """The kernels index inside one (batch, head) in int32: a view whose strides pass 2^31 there (the
    [B, N, H, D] layout transposed, at N·H·D ≥ 2^31) is made contiguous; what fits is left alone.
    Meta tensors: the shapes without the memory."""
    fits = torch.empty(2, 4, 1000, 64, device="meta")
    assert dispatch.fit_int32_offsets(fits) is fits
    hf_layout = torch.empty(1, 300_000, 64, 128, device="meta").transpose(1, 2)  # stride along N: 64·128
    assert (300_000 - 1) * hf_layout.stride(2) > 2**31 - 1
    fixed = dispatch.fit_int32_offsets(hf_layout)
    assert fixed.shape == hf_layout.shape and fixed.is_contiguous()
    small_view = torch.empty(1, 1000, 64, 128, device="meta").transpose(1, 2)
    assert dispatch.fit_int32_offsets(small_view) is small_view  # no copy where the strides fit
    with pytest.raises(ValueError, match="split the sequence"):
        dispatch.fit_int32_offsets(torch.empty(1, 1, 2**25, 128, device="meta"))


def test_launch_arithmetic_is_tritons():
    """The wrappers size grids and autotune buckets with host-side cdiv / next_power_of_2 (Triton's own are
    constexpr functions, microseconds a call): the numbers worked out here, and Triton's, for every length
    a launch has (n ≥ 1)."""
    triton = need_module("triton")
    for n in [*range(1, 300), 4095, 4096, 4097, 32768, 2**31 - 1]:
        assert dispatch.next_power_of_2(n) == 2 ** math.ceil(math.log2(n)) == triton.next_power_of_2(n)
        for block in (1, 16, 32, 64, 128):
            assert dispatch.cdiv(n, block) == math.ceil(n / block) == triton.cdiv(n, block)
    assert dispatch.cdiv(0, 64) == 0


def test_default_choice(monkeypatch):
    """Without the override: the reference on the CPU, Triton on CUDA when triton imports (decided here by
    importing it, not by the dispatcher's own check), and the default device's choice."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert kernel_backend("cpu") == "reference"
    expected_cuda = "triton" if TRITON_OK else "reference"
    assert kernel_backend(torch.device("cuda")) == expected_cuda
    assert kernel_backend() == (expected_cuda if torch.cuda.is_available() else "reference")


def test_cuda_without_triton_falls_back(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert kernel_backend("cuda") == "reference"
    with pytest.raises(RuntimeError, match="not installed"):
        dispatch.resolve_backend("triton", torch.zeros(1))


@pytest.mark.parametrize("value", ["triton", "reference", " Reference "])
def test_environment_override(monkeypatch, value):
    monkeypatch.setenv(dispatch.ENV_VAR, value)
    assert kernel_backend("cpu") == value.strip().lower()
    assert kernel_backend("cuda") == value.strip().lower()


def test_environment_override_rejects_unknown(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=dispatch.ENV_VAR):
        kernel_backend("cpu")


def test_override_reaches_the_kernels(monkeypatch, triton_backend, device):
    q = torch.randn(1, 1, 5, 16, device=device)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert attention_with_entropy(q, q, q).backend == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert attention_with_entropy(q, q, q).backend == "reference"


def test_torch_compile_traces_the_automatic_choice_in_one_graph_without_warnings(monkeypatch, triton_backend, device):
    """A compiled model runs its attention through the automatic backend choice on every call: dynamo traces
    it in one graph, with no graph break and no warning (an lru_cache there warned once per process)."""
    import warnings

    import torch._dynamo as dynamo

    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    q = torch.randn(1, 2, 16, 32, device=device)

    def attend(q, k, v):
        r = attention_with_entropy(q * 1.0, k, v, causal=True)
        return r.out.sum() + r.entropy.sum()

    attend(q, q, q)  # compiled and tuned first: on a GPU, Triton's own first-use warnings are not the question
    dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = dynamo.explain(attend)(q, q, q)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert [str(w.message) for w in caught] == []


def test_triton_on_cpu_needs_the_interpreter(monkeypatch, triton_backend):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        attention_with_entropy(q, q, q, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dimension_entropy(q, q, backend="triton")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(dispatch.ENV_VAR, None)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_model_compiled_before_any_eager_call_compiles_once():
    """A fresh process that registers the HF attention and then compiles before any eager call (as
    generate() with a static cache does): three calls, one graph. The triton check, traced unanswered,
    was a guard, and the second call compiled again."""
    code = (
        "import os\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "os.environ['LMSCOPE_KERNEL_BACKEND'] = 'triton'\n"
        "import torch\n"
        "from torch._dynamo.utils import counters\n"
        "from lmscope.kernels import attention_with_entropy, dispatch\n"
        "from lmscope.kernels.hf import register_attention\n"
        "assert dispatch._triton_found is None\n"
        "register_attention()\n"
        "@torch.compile(backend='eager')\n"
        "def f(q):\n"
        "    r = attention_with_entropy(q * 1.0, q, q, causal=True)\n"
        "    return r.out.sum() + r.entropy.sum()\n"
        "q = torch.randn(1, 2, 16, 32)\n"
        "f(q); f(q); f(q)\n"
        "print('graphs', counters['stats']['unique_graphs'])\n"
    )
    proc = _run(code)
    assert proc.returncode == 0 and "graphs 1" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


def test_import_is_light_and_works_without_triton():
    # importing the package loads neither triton nor transformers; with triton made unimportable
    # the kernels still run (reference) and CUDA would fall back to the reference too
    code = (
        "import sys\n"
        "import lmscope.kernels as K\n"
        "assert 'triton' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from lmscope.kernels import dispatch\n"
        "assert dispatch._triton_found is None  # not asked yet: the import does not look for triton\n"
        "assert not dispatch.triton_available()\n"
        "assert K.kernel_backend('cuda') == 'reference'\n"
        "q = torch.randn(1, 2, 6, 16)\n"
        "r = K.attention_with_entropy(q, q, q)\n"
        "assert r.backend == 'reference' and r.entropy.shape == (1, 2, 6)\n"
        "print('ok')\n"
    )
    proc = _run(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


# Builds the kernels as a GPU gets them (no TRITON_INTERPRET: autotuned), stops each launch at the autotuner
# and prints the candidates it keeps for that launch's arguments under each LMSCOPE_AUTOTUNE setting.
AUTOTUNE_SCRIPT = r"""
import json
import os
import sys

import torch
from triton.runtime.autotuner import Autotuner

from lmscope.kernels.attention_entropy.triton_kernel import attention_with_entropy_triton
from lmscope.kernels.dimension_entropy.triton_kernel import dimension_entropy_triton
from lmscope.kernels.favor.triton_kernel import favor_causal_triton


class Launched(Exception):
    pass


def capture(self, *args, **kwargs):
    raise Launched(self, args, kwargs)


Autotuner.run = capture


def launch(kernel, dtype, d, dv):
    dtype = getattr(torch, dtype)
    qk = lambda: torch.zeros(1, 2, 8, d, dtype=dtype)
    if kernel == "attention":
        attention_with_entropy_triton(qk(), qk(), torch.zeros(1, 2, 8, dv, dtype=dtype), causal=True, scale=0.1,
                                      key_padding_mask=None)
    elif kernel == "dimension":
        dimension_entropy_triton(qk(), qk(), causal=True, scale=0.1)
    else:  # FAVOR+ with 64 features
        favor_causal_triton(torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8),
                            torch.zeros(1, 2, 8, dv))


result = []
for case in json.loads(sys.argv[1]):
    try:
        launch(*case)
        raise AssertionError(f"{case}: nothing went through the autotuner")
    except Launched as launched:
        tuner, args, kwargs = launched.args
    tuner.nargs = dict(zip(tuner.arg_names, args))  # what Autotuner.run sets before pruning
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    kept = {}
    for setting in ("0", "off", " False ", "1", ""):
        os.environ["LMSCOPE_AUTOTUNE"] = setting
        kept[setting] = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                         for c in tuner.prune_configs(kwargs)]
    result.append(kept)
print(json.dumps(result))
"""


def _autotune_candidates(cases: list) -> list[dict]:
    """Per (kernel, dtype, D, Dv) launch: {LMSCOPE_AUTOTUNE setting: the configs the autotuner keeps}."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LMSCOPE_AUTOTUNE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", AUTOTUNE_SCRIPT, json.dumps(cases)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lmscope_autotune_0_keeps_only_each_kernels_first_candidate(triton_backend):
    """Every autotuned kernel (attention, dimension entropy, causal FAVOR+), built as on a GPU: with
    LMSCOPE_AUTOTUNE on it tunes over the candidates its config list allows for the launch (attention: the
    tiles of the input kind's and head-dim bucket's table, in sorted order; dimension entropy: all; FAVOR+:
    no value block wider than the values' next power of two, at least 16), and with it off over the first
    of them alone (the GPU test run compiles one tile per shape: it must fit a short session)."""
    from lmscope.kernels.attention_entropy import triton_kernel as attention
    from lmscope.kernels.dimension_entropy import triton_kernel as dimension
    from lmscope.kernels.favor import triton_kernel as favor

    def bucket(d):  # the kernel's head-dim block is the next power of two (≥ 16); tables per 64, 128, 256
        block = max(16, 2 ** math.ceil(math.log2(d)))
        return 64 if block <= 64 else block

    def attention_tiles(dtype, d, dv):
        return sorted(attention._TILES[(dtype == "float32", bucket(max(d, dv)))])

    def favor_tiles(dv):
        widest = max(16, 2 ** math.ceil(math.log2(dv)))
        return [t for t in favor._TILES if t[1] <= widest]

    dimension_tiles = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_D"], c.num_warps, c.num_stages)
                       for c in dimension._configs()]
    # (kernel, dtype, D, Dv) → the candidates expected, and how a kept config reads as a table row
    cases = {
        ("attention", "float32", 64, 64): attention_tiles("float32", 64, 64),
        ("attention", "float32", 128, 128): attention_tiles("float32", 128, 128),
        ("attention", "float32", 256, 256): attention_tiles("float32", 256, 256),
        ("attention", "bfloat16", 64, 64): attention_tiles("bfloat16", 64, 64),
        ("attention", "float16", 32, 32): attention_tiles("float16", 32, 32),  # 16-bit: the bf16 table
        ("attention", "bfloat16", 80, 80): attention_tiles("bfloat16", 80, 80),  # block 128
        ("attention", "bfloat16", 64, 128): attention_tiles("bfloat16", 64, 128),  # the wider of k and v
        ("attention", "bfloat16", 256, 256): attention_tiles("bfloat16", 256, 256),
        ("dimension", "float32", 16, 16): dimension_tiles,
        ("dimension", "bfloat16", 128, 128): dimension_tiles,
        ("favor", "float32", 64, 32): favor_tiles(32),
        ("favor", "float32", 64, 64): favor_tiles(64),
        ("favor", "float32", 64, 128): favor_tiles(128),
    }
    row = {
        "attention": lambda c: (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]),
        "dimension": lambda c: (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_D"], c["num_warps"], c["num_stages"]),
        "favor": lambda c: (c["BLOCK_N"], c["BLOCK_DV"], c["num_warps"], c["num_stages"]),
    }
    # each kernel has a launch with a choice to make, else "only the first" would hold trivially
    assert {kernel for (kernel, *_), tiles in cases.items() if len(tiles) > 1} == set(row)
    # the attention tables list the fastest tile first; the untuned choice is the smallest (sorted order)
    assert attention._TILES[(False, 64)][0] != attention_tiles("bfloat16", 64, 64)[0]

    for ((kernel, *shape), expected), got in zip(cases.items(), _autotune_candidates(list(cases))):
        assert expected, (kernel, shape)
        for off in ("0", "off", " False "):
            assert [row[kernel](c) for c in got[off]] == expected[:1], (kernel, shape, off)
        for on in ("1", ""):
            assert [row[kernel](c) for c in got[on]] == expected, (kernel, shape, on)


def test_favor_keeps_a_candidate_for_values_narrower_than_every_value_block(triton_backend):
    """Values 16 wide are narrower than every FAVOR+ value block (≥ 32): the pruning still leaves one
    candidate (Triton refuses an empty list), with the narrowest value block there is."""
    from lmscope.kernels.favor import triton_kernel as favor

    (kept,) = _autotune_candidates([("favor", "float32", 64, 16)])
    narrowest = min(t[1] for t in favor._TILES)
    assert narrowest > 16
    for setting, configs in kept.items():
        assert len(configs) == 1 and configs[0]["BLOCK_DV"] == narrowest, (setting, configs)


def test_with_lmscope_autotune_0_the_autotuner_times_nothing(triton_backend, monkeypatch):
    """Triton decides whether to tune from the unpruned config list, so it timed the one candidate
    LMSCOPE_AUTOTUNE=0 leaves (about 0.1 s per new shape of a short GPU session, to choose nothing). Off:
    no timing run and equal timings; on: Triton's own benchmarker (a stand-in here, no GPU) times the call."""
    import triton
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner

    from lmscope.kernels.tuning import autotune_on_gpu

    @triton.jit
    def copy_kernel(x_ptr, BLOCK: triton.language.constexpr):
        pass

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tuner, extra = autotune_on_gpu(copy_kernel, configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                                   key=[], interpreter_blocks={"BLOCK": 16})
    assert isinstance(tuner, Autotuner) and extra == {}
    timed = []

    class StandIn:  # the CUDA driver's part the autotuner asks for a benchmarker
        def get_benchmarker(self):
            return lambda kernel_call, quantiles: (kernel_call(), timed.append(quantiles), [1.0, 0.5, 2.0])[-1]

    monkeypatch.setattr(driver, "_active", StandIn())
    calls = []
    monkeypatch.setenv("LMSCOPE_AUTOTUNE", "0")
    assert tuner.do_bench(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
    assert calls == [] and timed == []
    monkeypatch.setenv("LMSCOPE_AUTOTUNE", "1")
    assert tuner.do_bench(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8)) == [1.0, 0.5, 2.0]
    assert calls == [1] and timed == [(0.5, 0.2, 0.8)]
