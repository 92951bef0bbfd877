"""`norms` end to end: submitted over HTTP (Flask test client), run by the embedded worker on the
built-in `tiny-gpt2` and `wikitext-2`, read back through the results and artifacts endpoints."""

from __future__ import annotations

import io

import numpy as np
import pytest


@pytest.mark.gpu
def test_norms_job_through_the_api(service):
    client, worker, _ = service
    params = {"model": "tiny-gpt2", "dataset": "wikitext-2", "max_samples": 12, "max_tokens": 48,
              "batch_size": 4, "loss_filter": None, "gram_samples": 6, "pca_samples": 6}
    r = client.post("/v1/jobs", json={"kind": "norms", "params": params})
    assert r.status_code == 202, r.get_json()
    job_id = r.get_json()["id"]

    assert worker.run_once()
    job = client.get(f"/v1/jobs/{job_id}").get_json()
    assert job["status"] == "succeeded", job["error"]
    s = job["summary"]
    assert s["samples"] == 12 and s["layers"] == 4 and s["trajectory_points"] == 4
    assert 0 <= s["sequence_pct"] <= s["pair_pct"] <= 100 and s["null_sequence_pct"] == pytest.approx(100 / 8)
    assert s["inner_loss_kept"] == 12 and 0 <= s["gram_condition_pct"] <= 100
    assert job["environment"]["kernel_backend"] in ("triton", "transformers-sdpa")

    from lmscope import demo  # what `make demo` prints of it

    grows, inner, gram = demo.headline(job)
    assert grows.startswith(f"the current token's norm grows at every layer in {s['sequence_pct']:.1f} % of 12 samples "
                            "(chance: 12.5 %)")
    assert inner.endswith(f"{s['inner_loss_final_mean']:.2f} nats") and f"{s['gram_condition_pct']:.0f} % of" in gram

    series = {x["name"]: x for x in client.get(f"/v1/jobs/{job_id}/results").get_json()["series"]}
    assert {"norm.mean", "norm.std", "norm.median", "inner_loss.mean", "inner_loss.std"} <= set(series)
    assert series["norm.mean"]["x"] == [0, 1, 2, 3] and series["inner_loss.mean"]["x"] == [0, 1, 2, 3]

    artifacts = {a["name"]: a for a in client.get(f"/v1/jobs/{job_id}/artifacts").get_json()["items"]}
    assert {"norms.png", "inner_loss.png", "pca3d.png", "trajectories.npz", "pca.npz"} <= set(artifacts)
    assert artifacts["norms.png"]["media_type"] == "image/png" and artifacts["norms.png"]["size"] > 20_000
    # the per-sample norms behind the series, downloaded and re-averaged
    npz = np.load(io.BytesIO(client.get(f"/v1/jobs/{job_id}/artifacts/trajectories.npz").data))
    np.testing.assert_allclose(series["norm.mean"]["y"], npz["norms"].mean(0), rtol=1e-6)
