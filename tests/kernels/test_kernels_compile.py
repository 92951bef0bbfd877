"""The compiled (GPU) path: the Triton kernels must compile for sm_90 without a GPU.

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

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmscope.kernels.attention_entropy import triton_kernel as tk
from lmscope.kernels.dimension_entropy import triton_kernel as dk

target = GPUTarget("cuda", 90, 32)

def sig(fn, constexprs, types):
    # a constexpr left out would be compiled as a runtime i32: a variant no launch ever builds
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"{fn.__name__}: give the constexprs {missing}"
    return {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}

# both precisions; soft-capping and the sliding window off and on (they add code to every key block)
for dt, prec, options in (("bf16", None, False), ("bf16", None, True), ("fp32", "ieee", True)):
    cfg = tk._prune(tk._configs(), {}, BLOCK_D=64, BLOCK_DV=64, INPUT_PRECISION=prec)[0]
    c = dict(HEAD_DIM=64, HEAD_DIM_V=64, BLOCK_D=64, BLOCK_DV=64, CAUSAL=True, HAS_KPM=True,
             SOFTCAP=options, WINDOW=options, INPUT_PRECISION=prec, INTERPRET=False, **cfg.kwargs)
    types = {"Q": "*" + dt, "K": "*" + dt, "V": "*" + dt, "Out": "*" + dt, "Ent": "*fp32", "Lse": "*fp32",
             "KPM": "*i8", "qk_scale": "fp32", "cap_log2": "fp32"}
    k = triton.compile(ASTSource(fn=tk._attn_entropy_fwd, signature=sig(tk._attn_entropy_fwd, c, types),
                                 constexprs=c), target=target,
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert "mma" in k.asm["ptx"] or dt == "fp32", "bf16 attention should use tensor cores"

cfg = dk._configs()[0]
c = dict(CAUSAL=True, INTERPRET=False, **cfg.kwargs)
types = {"Q": "*bf16", "K": "*bf16", "KMAX": "*bf16", "KMIN": "*bf16", "Out": "*fp32", "qk_scale": "fp32"}
triton.compile(ASTSource(fn=dk._dim_entropy_fwd, signature=sig(dk._dim_entropy_fwd, c, types), constexprs=c),
               target=target, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})

from lmscope.kernels.favor import triton_kernel as fk
types = {"PQ": "*fp32", "PK": "*fp32", "KM": "*fp32", "V": "*fp32", "Num": "*fp32", "Den": "*fp32"}
for cfg in fk._kernel.configs:  # every autotune candidate, as the wrapper launches it
    c = dict(BLOCK_M=fk.BLOCK_M, INPUT_PRECISION="tf32x3", INTERPRET=False, **cfg.kwargs)
    k = triton.compile(ASTSource(fn=fk._favor_causal_fwd, signature=sig(fk._favor_causal_fwd, c, types),
                                 constexprs=c), target=target,
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared  # fits an H100's shared memory
    assert "mma" in k.asm["ptx"], "3xTF32 FAVOR+ should use tensor cores"
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90(triton_backend, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "CompilationError" not in proc.stderr:
        pytest.skip(f"no usable ptxas in this triton install: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
