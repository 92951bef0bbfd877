"""Backend choice for the kernels: Triton on CUDA tensors, the PyTorch reference elsewhere.

``LMSCOPE_KERNEL_BACKEND=triton|reference`` overrides the automatic choice. Triton on CPU tensors
only works under ``TRITON_INTERPRET=1`` (how the tests run the kernels). Jobs record
``kernel_backend(device)`` so every number says which code produced it. Also the argument checks
the kernels share (``forward_backend``, ``check_heads``, ``check_floating``, ``check_scale``,
``check_count``, ``check_grid``, ``fit_int32_offsets``), ``repeat_kv`` for grouped-query heads, and the launch arithmetic (``cdiv``,
``next_power_of_2``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
import os

import torch

from lmscope.config import KERNEL_BACKENDS, forced_kernel_backend, on_off

BACKENDS = KERNEL_BACKENDS
ENV_VAR = "LMSCOPE_KERNEL_BACKEND"
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the Triton kernels take (fp32 accumulators)


_triton_found: bool | None = None  # asked once per process


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (a CPU worker may not have it)."""
    # A module global rather than functools.lru_cache: torch.compile traces this call (through the HF
    # attention function) and warns about every lru_cache it meets; a global it simply reads.
    global _triton_found
    if _triton_found is None:
        try:
            _triton_found = importlib.util.find_spec("triton") is not None
            if _triton_found:
                import triton  # noqa: F401
        except Exception:  # a broken or blocked install counts as missing: fall back rather than crash
            _triton_found = False
    return _triton_found


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter (CPU tensors, no autotuning)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device_of(t: torch.Tensor):
    """Launch on ``t``'s GPU: Triton launches on the current CUDA device, which need not be the
    tensor's (a model spread over several GPUs), and fails there on the foreign pointers."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


AUTOTUNE_ENV_VAR = "LMSCOPE_AUTOTUNE"


def autotuning() -> bool:
    """``LMSCOPE_AUTOTUNE`` on (the default) or off, read at every launch that tunes; anything else is
    refused, as lmscope.config refuses its variables."""
    return on_off(os.environ, AUTOTUNE_ENV_VAR, True)


def forced_backend() -> str | None:
    """The backend ``LMSCOPE_KERNEL_BACKEND`` asks for (validated: lmscope.config.ConfigError), or None when
    it is unset."""
    return forced_kernel_backend(os.environ)


def kernel_backend(device: torch.device | str | None = None) -> str:
    """The backend ("triton" or "reference") the kernels use for tensors on ``device``.

    ``device=None`` means the default compute device (CUDA when present). The environment override
    wins; without it, CUDA devices get Triton when it is installed and everything else the reference.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    forced = forced_backend()
    if forced is not None:
        return forced
    return "triton" if device.type == "cuda" and triton_available() else "reference"


def resolve_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """Validate an explicit ``backend=`` argument or pick one for the tensors' device."""
    if backend is None:
        backend = kernel_backend(tensors[0].device)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)} or None")
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend 'triton' requested but triton is not installed; use backend='reference'")
        devices = {t.device.type for t in tensors}
        if devices != {"cuda"} and not interpreting():
            raise RuntimeError(
                f"backend 'triton' needs CUDA tensors (got {sorted(devices)}); "
                "set TRITON_INTERPRET=1 before triton is imported to run kernels on the CPU"
            )
    return backend


def check_heads(h: int, hk: int) -> None:
    """Grouped-query attention: H query heads share H_kv key/value heads, so H must be a multiple of H_kv."""
    if hk == 0 or h % hk != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hk})")


def check_floating(name: str, **tensors: torch.Tensor) -> None:
    """The kernels compute softmax attention: integer or boolean inputs are a mistake, not a cast to make,
    and a head dim of 0 has no scores."""
    for arg, t in tensors.items():
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} must be a floating-point tensor (float32, float16, bfloat16 or "
                            f"float64); got {t.dtype}")
        if t.shape[-1] == 0:
            raise ValueError(f"{name}: {arg} has head dim 0; it must be at least 1")


def check_scale(name: str, scale) -> float | None:
    """``scale`` as a float, or None (the default 1/sqrt(D)); refuses what is not a finite real number (a
    string, a bool, NaN, ±inf): every score would be NaN or ±inf, and the rows silently meaningless."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) and not (  # numpy scalars are Real
            isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.dtype.is_complex):
        raise TypeError(f"{name}: scale must be a real number or None; got {scale!r}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"{name}: scale must be finite; got {value}")
    return value


def check_count(name: str, arg: str, value, least: int = 1) -> int:
    """A whole number ≥ ``least`` (``num_features``, ``seed``): 16.0 or True are refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name}: {arg} must be a whole number >= {least}; got {value!r}")
    return int(value)


def check_grid(batch_heads: int) -> None:
    """The kernels put batch x heads on a grid axis that CUDA caps at 65535 programs."""
    if batch_heads > 65535:
        raise ValueError(f"B*H = {batch_heads} exceeds the CUDA grid limit (65535); split the batch")


INT32_MAX = 2**31 - 1


def fit_int32_offsets(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, H, N, D], or a contiguous copy when an offset inside one (batch, head) slice would pass
    2^31 − 1: the kernels compute those in 32-bit integers (the slice's base is 64-bit). A view of
    transformers' [B, N, H, D] layout has stride H·D along N, and passes it from N·H·D ≈ 2^31."""
    _, _, n, d = t.shape
    _, _, stride_n, stride_d = t.stride()
    if (n - 1) * stride_n + (d - 1) * stride_d <= INT32_MAX:  # plain arithmetic: this runs at every launch
        return t
    if t.shape[2:].numel() > INT32_MAX + 1:
        raise ValueError(f"one head of {tuple(t.shape)} holds more than 2^31 elements; split the sequence")
    return t.contiguous()


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for the launch grids. Host code, not ``triton.cdiv``: that is a constexpr function whose
    call wrapper costs microseconds, paid on every launch (the wrappers' host time bounds short calls)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1): ``triton.next_power_of_2`` without its call wrapper."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def repeat_kv(t: torch.Tensor, h: int) -> torch.Tensor:
    """[B, H_kv, N, D] → [B, H, N, D]: each key/value head repeated for the H/H_kv query heads it serves."""
    hk = t.shape[1]
    return t if hk == h else t.repeat_interleave(h // hk, dim=1)


def triton_dtype_refusal(t: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take ``t``'s dtype (they take float32/float16/bfloat16), or None."""
    return None if t.dtype in TRITON_DTYPES else f"the Triton kernels take float32/float16/bfloat16, not {t.dtype}"


def forward_backend(backend: str | None, name: str, *tensors: torch.Tensor, refusal: str | None = None) -> str:
    """``resolve_backend`` for the kernels, whose Triton paths are all forward-only, given what the Triton
    path cannot take: tensors that need gradients, and ``refusal`` (default: the first tensor's dtype).

    The automatic choice then runs the reference, on any device (training the sweep's networks keeps its
    gradients; a model with head_dim 512 on a GPU still runs, and its result says which backend ran).
    Asking for Triton by name is an error, not a silent loss of gradients.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        refusal = "the Triton path has no autograd, and these tensors need gradients (or run under torch.no_grad())"
    elif refusal is None:
        refusal = triton_dtype_refusal(tensors[0])
    if refusal is None:
        return resolve_backend(backend, *tensors)
    if backend is not None and resolve_backend(backend, *tensors) == "triton":
        raise ValueError(f"{name}: {refusal}; use backend='reference' or None")
    return "reference"
