"""Device memory: giving it back, and filling it without waiting (torch only: the worker calls
``free_memory`` after an out-of-memory failure without importing transformers)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch


def free_memory() -> None:
    """Give memory no tensor uses back: collect cycles, and empty torch's CUDA cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, without making the host wait for the GPU.

    A plain ``.to("cuda")`` from pageable memory synchronises the stream: the host stops until every
    kernel queued before it has run, and the GPU then idles until the next ones are queued. From pinned
    memory the copy is queued like a kernel (torch's host allocator keeps the buffer until it is done).
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def available_bytes(device: str | torch.device) -> int | None:
    """Memory a job may still fill on ``device``: free GPU memory plus what torch's allocator holds
    unused; on the host, the kernel's MemAvailable. None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_room()  # a container's memory limit: the host may have far more than the job may use
    return min((b for b in (free, limit) if b is not None), default=None)


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's cgroup (v2, else v1) still allows: its limit less its usage; None without one."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:  # v1 writes "no limit" as ~2^63
            return None
        return max(0, int(limit) - usage)
    return None
