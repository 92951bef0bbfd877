"""What the benchmark scripts share: a model from a spec or a random-init config, a device sync before
reading the clock, OOM detection.

Imported by the scripts as ``from _common import …`` (``python benchmarks/<name>.py`` puts this folder on
``sys.path``); each script keeps its own ``bench-*`` model shapes.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_spec(spec: str, dtype: str, device: str):
    """A built-in model by name (``catalog.BUILTIN_MODELS``), else a Hugging Face directory at path ``spec``."""
    from lmscope.catalog import BUILTIN_MODELS
    from lmscope.modeling.loading import load_model

    if spec in BUILTIN_MODELS:
        return load_model(spec, "builtin", None, dtype=dtype, device=device)
    return load_model(Path(spec).name, "directory", spec, dtype=dtype, device=device)


def random_init(name: str, config, dtype: str, device: str):
    """A ``bench-*`` model: ``config`` with seeded random weights (timings do not depend on them), sdpa
    attention, the byte tokenizer (byte ids fit every vocabulary here)."""
    from transformers import AutoModelForCausalLM

    from lmscope.modeling.loading import DTYPES, LoadedModel, cast_model, model_info
    from lmscope.modeling.tokenization import byte_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = cast_model(model, device=device, dtype=DTYPES[dtype]).eval()
    return LoadedModel(name, model, byte_tokenizer(), model_info(model))


def sync(device) -> None:
    """Wait for the queued GPU work, so a wall-clock reading covers it (no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def is_oom(e: BaseException) -> bool:
    """An out-of-memory error: CUDA's, one raised as RuntimeError with that message, or the host's."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def gpu_busy(fn, device) -> float | None:
    """The share of fn()'s wall time the GPU spent running kernels (their summed device time over the
    wall time of one profiled run), or None off CUDA or where the profiler reports no device time.
    Well below 1, the host sets the pace (Python, launches, waits for the device), not the GPU; the
    profiler's own overhead makes it an underestimate."""
    if not str(device).startswith("cuda"):
        return None
    import time

    from torch.profiler import ProfilerActivity, profile

    try:
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            fn()
            sync(device)
            wall = time.perf_counter() - start
        # the device's own events (kernels, copies), each once; a CPU op's entry also carries its kernels
        busy_us = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - a diagnostic: a profiler that fails must not cost the benchmark
        return None
    return busy_us / 1e6 / wall if busy_us > 0 else None
