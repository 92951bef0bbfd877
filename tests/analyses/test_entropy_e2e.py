"""`entropy` end to end: a tiny `train` job, then the entropy job on its checkpoints, both submitted
over HTTP (Flask test client), run by the embedded worker, read back through results and artifacts;
the numbers are checked against the eager attention of the checkpoint loaded from disk."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lmscope.catalog import read_documents
from lmscope.modeling.loading import load_model
from lmscope.modeling.windows import token_windows
from tests.analyses.conftest import train_tiny_run


def submit(client, kind, params):
    r = client.post("/v1/jobs", json={"kind": kind, "params": params})
    assert r.status_code == 202, r.get_json()
    return r.get_json()["id"]


def finished(client, worker, job_id):
    assert worker.run_once()
    job = client.get(f"/v1/jobs/{job_id}").get_json()
    assert job["status"] == "succeeded", job["error"]
    return job


@pytest.mark.gpu
def test_entropy_over_a_train_jobs_checkpoints(service):
    client, worker, settings = service
    train_job = train_tiny_run(client, worker, settings, "ent")  # checkpoints from the init on

    params = {"train_job": train_job["id"], "dataset": "wiki-slice", "seq_len": 32, "num_segments": 3,
              "batch_size": 2, "dimension_wise": True, "dimension_segments": 1}
    job_id = submit(client, "entropy", params)
    job = finished(client, worker, job_id)
    s = job["summary"]
    assert s["models"] == ["ent@step0", "ent@step2", "ent@step4"] and s["steps"] == [0, 2, 4]
    assert (s["layers"], s["heads"], s["tokens"]) == (2, 4, 3 * 32)
    assert job["environment"]["kernel_backend"] == s["kernel_backend"] in ("reference", "triton")
    assert job["progress"]["done"] == job["progress"]["total"] == 3 * (2 + 1)  # 2 + 1 batches per checkpoint

    from lmscope import demo  # what `make demo` prints of them

    at, heads = demo.headline(job)
    assert at.startswith(f"at ent@step4: mean attention entropy {s['mean_entropy']:.2f} nats, ")
    assert heads.endswith("curves over 3 checkpoints in entropy_over_training.png")
    loss, checkpoints = demo.headline(train_job)
    assert loss.startswith(f"validation loss {train_job['summary']['val_loss']:.2f} nats after 4 steps")
    assert checkpoints == "checkpoints: ent@step0, ent@step2, ent@step4"

    series = client.get(f"/v1/jobs/{job_id}/results").get_json()["series"]
    means = [x for x in series if x["name"] == "entropy.mean"]
    assert len(means) == 2 * 4 and all(x["x"] == [0, 2, 4] for x in means)
    artifacts = {a["name"]: a for a in client.get(f"/v1/jobs/{job_id}/artifacts").get_json()["items"]}
    assert {"entropy_heatmap.png", "entropy_by_layer.png", "entropy_by_position.png", "entropy_over_training.png",
            "dimension_entropy.png", "entropy_by_position.npz", "dimension_entropy.npz"} <= set(artifacts)
    npz = np.load(io.BytesIO(client.get(f"/v1/jobs/{job_id}/artifacts/entropy_by_position.npz").data))
    for x in means:
        np.testing.assert_allclose(x["y"], npz["mean"][:, x["labels"]["layer"], x["labels"]["head"]], rtol=1e-9)

    # The last checkpoint from disk, eager attention matrices, -Σ p ln p in float64.
    path = settings.job_dir(train_job["id"]) / "checkpoints" / "step-4"
    lm = load_model("ent@step4", "checkpoint", str(path))
    lm.model.set_attn_implementation("eager")
    windows = token_windows(lm.tokenizer, read_documents(settings.wikitext2_path, "lines")[:400], 32, 3)
    with torch.no_grad():
        attentions = lm.model(input_ids=windows, output_attentions=True, use_cache=False).attentions
    for layer, p in enumerate(attentions):
        p = p.double()
        ent = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)  # [W, H, N]
        np.testing.assert_allclose(npz["by_position"][2, layer], ent.mean(0).numpy(), atol=2e-5)


def test_submit_refuses_bad_entropy_params(service):
    client, _, _ = service
    r = client.post("/v1/jobs", json={"kind": "entropy", "params": {"dataset": "wikitext-2", "model": "tiny-gpt2",
                                                                     "train_job": 1}})
    assert r.status_code == 422 and "exactly one of 'model'" in r.get_data(as_text=True)
    r = client.post("/v1/jobs", json={"kind": "entropy", "params": {"dataset": "wikitext-2", "train_job": 999}})
    assert r.status_code == 422 and "job 999 does not exist" in r.get_data(as_text=True)
