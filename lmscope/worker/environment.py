"""Where a job ran: versions, device, kernel backend, host, wall time per stage (DESIGN.md §2).

Torch is imported only when the job already imported it or runs on CUDA, so a job kind that never
touches torch does not pay for it (and the Celery main process never initialises CUDA).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import socket
import sys
from typing import Any

import lmscope
from lmscope.config import forced_device

PACKAGES = ("torch", "triton", "transformers")


def worker_id() -> str:
    """``host:pid`` of this process: the job row's ``worker`` field (the pid is what a test kills)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@functools.lru_cache(maxsize=None)
def _device_for_pid(pid: int) -> str:
    forced = forced_device(os.environ)
    if forced:
        return forced
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def worker_device() -> str:
    """``LMSCOPE_DEVICE``, else cuda when available, else cpu. Call only where CUDA may be touched."""
    return _device_for_pid(os.getpid())


def device_failure(device: str) -> str | None:
    """After a failed job: None if ``device`` still runs work, else CUDA's error. An illegal address or a
    device-side assert leaves the process's CUDA context unusable: every later call in the process fails.
    Running out of memory does not (the probe itself may, while another job holds the memory)."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_initialized():  # the job never touched CUDA: it cannot have broken it
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except torch.OutOfMemoryError:
        return None
    except Exception as e:  # torch.AcceleratorError on recent torch, RuntimeError before
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def package_versions() -> dict[str, str]:
    """Versions of lmscope and of the heavy packages that are installed (importable) here."""
    versions = {"lmscope": lmscope.__version__, "python": platform.python_version()}
    for name in PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "unknown")
    return versions


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index
        return torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)
    return _cpu_name()


def default_kernel_backend(device: str) -> str | None:
    """The dispatcher's choice for this device, if the job used torch at all (else None)."""
    if "torch" not in sys.modules:
        return None
    try:
        from lmscope.kernels.dispatch import kernel_backend
    except Exception:
        return None
    try:
        return kernel_backend(device)
    except Exception:
        return None


def environment_record(device: str, stages: dict[str, float], wall_seconds: float,
                       recorded: dict[str, Any], *, attempt: int, worker: str) -> dict[str, Any]:
    """The job's ``environment`` JSON: facts the job recorded win over the defaults."""
    env: dict[str, Any] = package_versions()
    env.update(host=socket.gethostname(), worker=worker, attempt=attempt, device=device)
    try:
        env["device_name"] = device_name(device)
    except Exception as e:  # never fail a finished job over a cosmetic fact
        env["device_name"] = f"unknown ({type(e).__name__})"
    backend = default_kernel_backend(device)
    if backend:
        env["kernel_backend"] = backend
    if "torch" in sys.modules:  # CPU sums round by thread count: a bit-identical rerun needs the same
        env["torch_threads"] = sys.modules["torch"].get_num_threads()
    env["stages"] = {name: round(seconds, 6) for name, seconds in stages.items()}
    env["wall_seconds"] = round(wall_seconds, 6)
    env.update(recorded)
    return env
