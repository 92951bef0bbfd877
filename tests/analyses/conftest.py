"""The analyses' tests: the eager-attention entropy oracle, and the embedded service (Flask test client +
in-process worker) for the end-to-end tests."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lmscope.analyses.base import LoadedModel
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Counts the ops that, on a GPU, make the host wait for the device: reading a value back
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


def eager_entropies(loaded: LoadedModel, windows: torch.Tensor) -> np.ndarray:
    """[L, W, H, N] float64 entropies of the eager attention matrices of a copy of the model.

    Models that compute attention in their own modules (Falcon) build their mask by the configured
    implementation, so the copy's config says eager too; the matrices are checked to be causal
    distributions (an sdpa mask added to eager scores once hid nothing, in the job and here alike)."""
    model = copy.deepcopy(loaded.model)
    if getattr(model, "_supports_attention_backend", False):
        model.set_attn_implementation("eager")
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = model(input_ids=windows.to(model.device), output_attentions=True, use_cache=False).attentions
    for p in attentions:
        assert torch.allclose(p.double().sum(-1), torch.ones((), dtype=torch.float64, device=p.device), atol=1e-5)
        assert float(p.double().triu(1).abs().max()) == 0.0, "an eager matrix with weight on future keys"
    return np.stack([(-torch.special.xlogy(p.double(), p.double()).sum(-1)).cpu().numpy() for p in attentions])


@pytest.fixture
def service(settings_factory, sqlite_url):
    """(test client, embedded worker, settings) on a fresh SQLite database with the built-ins registered."""
    from lmscope.api import create_app
    from lmscope.db.builtins import ensure_builtins
    from lmscope.db.engine import make_engine, make_sessionmaker
    from lmscope.queue import LocalPublisher
    from lmscope.worker.embedded import EmbeddedWorker

    settings = settings_factory(database_url=sqlite_url, auth=False)
    engine = make_engine(sqlite_url)
    sessions = make_sessionmaker(engine)
    ensure_builtins(settings, sessions)
    publisher = LocalPublisher()
    app = create_app(settings, publisher=publisher)
    yield app.test_client(), EmbeddedWorker(settings, sessions, publisher), settings
    engine.dispose()
