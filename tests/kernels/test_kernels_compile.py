"""The compiled (GPU) path: the Triton kernels must compile for sm_90 without a GPU, every autotune
candidate must fit an H100's 227 KB of shared memory, and each kernel's first candidate (the untuned
choice, LMSCOPE_AUTOTUNE=0) the 99 KB of sm_86/sm_89 parts (A10, A40, L4, L40S, RTX 30/40), the least
of the recent ones. There the autotuner passes over the larger tiles (Triton counts a tile that runs
out of shared memory as infinitely slow), so every kernel keeps at least one that fits.

The interpreter is lenient where the compiler is not (non-constexpr globals, loop-carried types,
constexpr branches), so the interpreted tests alone would let a kernel that cannot compile pass.
Compiling needs no device: triton ships ptxas. Runs in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import os
import sys
import time

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import native_specialize_impl

from lmscope.kernels.attention_entropy.triton_kernel import attention_with_entropy_triton
from lmscope.kernels.dimension_entropy.triton_kernel import dimension_entropy_triton
from lmscope.kernels.favor.triton_kernel import favor_causal_triton

target = GPUTarget("cuda", int(sys.argv[1]), 32)
SHARED_MEMORY = int(sys.argv[2]) * 1024  # per block
EVERY_CANDIDATE_FITS = sys.argv[3] == "every"  # else the first candidate must fit, the others may not


class Launched(Exception):
    pass


def capture(self, *args, **kwargs):  # stands in for the autotuner's launch: keep what it was given
    raise Launched(self, args, kwargs)


Autotuner.run = capture


def compile_launch(name, call, every_candidate=False):
    # Compile for sm_90 what `call` launches, specialised as a launch specialises it: pointers 16-byte
    # aligned and ints divisible by 16 get divisibility hints (vectorised loads, cp.async pipelining),
    # ints equal to 1 become constants. Without the hints the compiler builds a kernel no launch runs.
    try:
        call()
        raise AssertionError(f"{name}: nothing was launched")
    except Launched as launched:
        tuner, args, kwargs = launched.args
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    tuner.nargs = dict(zip(tuner.arg_names, args))
    configs = tuner.prune_configs(kwargs)  # the kernel's own pruning: the candidates a GPU would tune
    assert configs, name
    fn = tuner.fn
    for n, cfg in enumerate(configs if every_candidate else configs[:1]):
        values = {**dict(zip(fn.arg_names, args)), **kwargs, **cfg.kwargs}
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            value = values[p.name]
            kind, spec = ("constexpr", None) if p.is_constexpr else native_specialize_impl(
                BaseBackend, value, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
            signature[p.name] = kind
            if kind == "constexpr":
                constexprs[p.name] = value
            elif spec and "D" in spec:
                attrs[(i,)] = [["tt.divisibility", 16]]
        t0 = time.time()
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                           target=target, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        ptx = k.asm["ptx"]
        print(f"{name} {cfg}: shared {k.metadata.shared} B, cp.async {'cp.async' in ptx}, "
              f"mma {'mma' in ptx}, {time.time() - t0:.1f} s", flush=True)
        if k.metadata.shared > SHARED_MEMORY:
            assert n > 0 and not EVERY_CANDIDATE_FITS, (name, cfg, k.metadata.shared)
            print(f"  too big for {SHARED_MEMORY // 1024} KB: the autotuner passes it over", flush=True)
            continue
        yield k, ptx


def qkv(b, h, hk, n, d, dtype, hf_layout=False):
    if hf_layout:  # transformers hands q as [B, N, H, D].transpose(1, 2)
        return (torch.empty(b, n, h, d, dtype=dtype).transpose(1, 2),
                torch.empty(b, n, hk, d, dtype=dtype).transpose(1, 2),
                torch.empty(b, n, hk, d, dtype=dtype).transpose(1, 2))
    return torch.empty(b, h, n, d, dtype=dtype), torch.empty(b, hk, n, d, dtype=dtype), torch.empty(b, hk, n, d, dtype=dtype)


# bf16 at every head-dim bucket with every candidate tile; the soft cap, window and padding mask (they add
# code to every key block); GQA in transformers' layout; fp32 (exact dot products, no tensor cores).
cases = [
    ("attention bf16 D=64", dict(d=64), True),
    ("attention bf16 D=128", dict(d=128), True),
    ("attention bf16 D=256", dict(d=256), True),
    ("attention bf16 D=128 softcap+window+mask", dict(d=128, options=True), True),
    ("attention bf16 D=128 GQA, transformers layout", dict(d=128, hk=2, hf_layout=True), False),
    ("attention fp32 D=64", dict(d=64, dtype=torch.float32), False),
    ("attention fp32 D=128", dict(d=128, dtype=torch.float32), True),
]
for name, case, every in cases:
    d, dtype, options = case["d"], case.get("dtype", torch.bfloat16), case.get("options", False)
    q, k, v = qkv(1, 8, case.get("hk", 8), 1024, d, dtype, case.get("hf_layout", False))
    mask = torch.ones(1, 1024, dtype=torch.bool) if options else None
    call = lambda: attention_with_entropy_triton(q, k, v, causal=True, scale=d ** -0.5, key_padding_mask=mask,
                                                 softcap=50.0 if options else None, window=256 if options else None)
    for kernel, ptx in compile_launch(name, call, every):
        if dtype == torch.bfloat16:
            assert "mma" in ptx, f"{name}: bf16 attention should use tensor cores"
            assert "cp.async" in ptx, f"{name}: key/value loads should be pipelined"

q, k, _ = qkv(1, 8, 8, 1024, 64, torch.bfloat16)
for causal in (True, False):
    list(compile_launch(f"dimension entropy causal={causal}", lambda: dimension_entropy_triton(q, k, causal=causal, scale=0.125)))

phi_q, phi_k = torch.empty(1, 8, 1024, 256), torch.empty(1, 8, 1024, 256)
key_max, v = torch.empty(1, 8, 1024), torch.empty(1, 8, 1024, 64)
for kernel, ptx in compile_launch("favor+ causal", lambda: favor_causal_triton(phi_q, phi_k, key_max, v), True):
    assert "mma" in ptx, "3xTF32 FAVOR+ should use tensor cores"
print("compiled")
"""


def _ptxas_path(compute_capability: int) -> str:
    """The ptxas binary triton's CUDA backend runs for sm_<compute_capability> (raises when it finds none)."""
    try:  # triton ≥ 3.4: the function make_cubin calls (3.9 takes ptxas-blackwell from sm_90, 3.6 from sm_100)
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        get_ptxas = None
    if get_ptxas is not None:
        return get_ptxas(compute_capability).path
    import triton

    if hasattr(triton, "knobs"):
        return triton.knobs.nvidia.ptxas.path
    # older: TRITON_PTXAS_PATH, else the binary the wheel ships
    return os.environ.get("TRITON_PTXAS_PATH") or str(
        Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def ptxas_refusal(compute_capability: int) -> str | None:
    """None when the ptxas triton would run for this target starts and reports its version, else why not."""
    try:
        path = _ptxas_path(compute_capability)
    except Exception as e:  # triton's own lookup: RuntimeError("Cannot find ptxas") when none runs
        return f"triton finds none ({e!r})"
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{path} does not run ({e!r})"
    if proc.returncode != 0 or "release" not in proc.stdout:
        return f"`{path} --version` exited {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("compute_capability,shared_kb,fits", [(90, 227, "every"), (86, 99, "first")],
                         ids=["sm90-h100", "sm86-99KB"])
def test_kernels_compile(triton_backend, tmp_path, compute_capability, shared_kb, fits):
    # Only a ptxas that is missing or does not start is a reason to skip (an error in CI). One that runs
    # and rejects the generated PTX (PTXASError, "`ptxas` failed ...") is the failure this test is for.
    why_not = ptxas_refusal(compute_capability)
    need(why_not is None, f"no usable ptxas for sm_{compute_capability}: {why_not}")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LMSCOPE_AUTOTUNE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    env["TMPDIR"] = str(tmp_path)  # triton's ptxas step leaves its .ptx/.log temporaries behind
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(compute_capability), str(shared_kb), fits], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
