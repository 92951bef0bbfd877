"""Which ops make the host wait for the device: counted by a dispatch mode, on any device.

A GPU job that reads a value back (``.item()``, ``bool(t)``) or runs an op whose output size depends on the
data makes Python wait for every kernel queued before it; such an op also cannot be captured in a CUDA
graph. `HostReads` records them as they run, on CPU tensors alike, so a CPU test shows what a GPU run
would wait for, and a GPU run can look before it captures (`sumformer_fit.TrainingSteps`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Records the ops that, on a GPU, make the host wait for the device: reading a value back
    (``.item()``, ``bool()``, ``int()``), and ops whose output size depends on the data (``nonzero``,
    boolean-mask indexing, ``bincount``, ``unique``, ...). Counted on CPU tensors alike, so a CPU test
    shows what a GPU run would wait for. (Blocking host→device copies are not seen on a CPU.)"""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique", "unique_dim",
               "unique_consecutive", "repeat_interleave", "_assert_async")

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ())
        if bool_index or any(name == s or name.startswith(s + ".") for s in self.SYNCING):
            self.ops.append(name)
        return func(*args, **kwargs)


__all__ = ["HostReads"]
