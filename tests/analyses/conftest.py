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


def train_tiny_run(client, worker, settings, run_name: str) -> dict:
    """Through the API and the embedded worker: a 2-layer grouped-query LLaMA trained for 4 steps on a slice of
    WikiText-2 (uploaded as `wiki-slice`: tokenizer training stays short), checkpoints at steps 0, 2 and 4.
    Returns the finished train job."""
    lines = settings.wikitext2_path.read_text(encoding="utf-8").splitlines(keepends=True)[:400]
    r = client.post("/v1/datasets?name=wiki-slice&format=lines", data="".join(lines).encode(), content_type="text/plain")
    assert r.status_code == 201, r.get_json()
    train = {"dataset": "wiki-slice", "architecture": "llama", "layers": 2, "width": 32, "heads": 4, "kv_heads": 2,
             "context": 32, "tokenizer": "bpe", "vocab_size": 300, "steps": 4, "batch_size": 2, "checkpoint_every": 2,
             "eval_every": 2, "eval_batches": 1, "warmup_steps": 1, "run_name": run_name}
    r = client.post("/v1/jobs", json={"kind": "train", "params": train})
    assert r.status_code == 202, r.get_json()
    assert worker.run_once()
    job = client.get(f"/v1/jobs/{r.get_json()['id']}").get_json()
    assert job["status"] == "succeeded", job["error"]
    assert job["summary"]["checkpoints"] == [f"{run_name}@step0", f"{run_name}@step2", f"{run_name}@step4"]
    return job
