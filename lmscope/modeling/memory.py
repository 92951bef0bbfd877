"""Device memory: giving it back, and filling it without waiting (torch only: the worker calls
``free_memory`` after an out-of-memory failure without importing transformers)."""

from __future__ import annotations

import gc

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
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
