"""The analyses' tests: the eager-attention entropy oracle, and the embedded service (Flask test client +
in-process worker) for the end-to-end tests."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lmscope.analyses.base import LoadedModel


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
