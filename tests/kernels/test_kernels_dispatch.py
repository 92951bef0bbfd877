"""Backend choice, its environment override, and the light import of lmscope.kernels."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmscope.kernels import attention_with_entropy, dimension_entropy, dispatch, kernel_backend

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
    triton = pytest.importorskip("triton")
    for n in [*range(1, 300), 4095, 4096, 4097, 32768, 2**31 - 1]:
        assert dispatch.next_power_of_2(n) == 2 ** math.ceil(math.log2(n)) == triton.next_power_of_2(n)
        for block in (1, 16, 32, 64, 128):
            assert dispatch.cdiv(n, block) == math.ceil(n / block) == triton.cdiv(n, block)
    assert dispatch.cdiv(0, 64) == 0


def test_default_choice(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert kernel_backend("cpu") == "reference"
    expected_cuda = "triton" if dispatch.triton_available() else "reference"
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
        "dispatch.triton_available.cache_clear()\n"
        "assert not dispatch.triton_available()\n"
        "assert K.kernel_backend('cuda') == 'reference'\n"
        "q = torch.randn(1, 2, 6, 16)\n"
        "r = K.attention_with_entropy(q, q, q)\n"
        "assert r.backend == 'reference' and r.entropy.shape == (1, 2, 6)\n"
        "print('ok')\n"
    )
    proc = _run(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_lmscope_autotune_0_keeps_only_each_kernels_first_candidate(monkeypatch):
    """The GPU test run compiles one tile per shape instead of tuning all (it must fit a short session)."""
    import triton

    from lmscope.kernels import tuning
    from lmscope.kernels.attention_entropy import triton_kernel as tk

    monkeypatch.setattr(tuning, "interpreting", lambda: False)  # build the autotuned kernel a GPU gets
    tuner, extra = tuning.autotune_on_gpu(tk._attn_entropy_fwd, configs=tk._configs(), key=["HEAD_DIM"],
                                         interpreter_blocks={"BLOCK_M": 32, "BLOCK_N": 32}, prune=tk._prune)
    assert isinstance(tuner, triton.runtime.autotuner.Autotuner) and extra == {}
    kwargs = dict(BLOCK_D=128, BLOCK_DV=128, INPUT_PRECISION=None)
    every = tk._prune(tk._configs(), {}, **kwargs)
    assert len(every) == 4
    for off in ("0", "off", " False "):
        monkeypatch.setenv("LMSCOPE_AUTOTUNE", off)
        assert tuner.early_config_prune(tuner.configs, {}, **kwargs) == every[:1]
    for on in ("1", ""):
        monkeypatch.setenv("LMSCOPE_AUTOTUNE", on)
        assert tuner.early_config_prune(tuner.configs, {}, **kwargs) == every
