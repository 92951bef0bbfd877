"""What the benchmark scripts share: a model from a spec, a device sync before reading the clock, OOM detection.

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


def sync(device) -> None:
    """Wait for the queued GPU work, so a wall-clock reading covers it (no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def is_oom(e: BaseException) -> bool:
    """An out-of-memory error: CUDA's, one raised as RuntimeError with that message, or the host's."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()
