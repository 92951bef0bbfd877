"""`make demo` run twice: the second run reuses the first one's training job (README), through the
real API and client, so it depends on the stored params reading back equal to the example file's."""

from __future__ import annotations

from lmscope import demo
from lmscope.client import Client


def test_a_second_demo_reuses_the_training_job_that_succeeded(api, live):
    api.user("ann")
    client = Client(live.url, api.tokens["ann"])
    params = demo.example("train_demo.json")
    assert demo.previous_training(client, params) is None

    job = client.submit("train", params, name="demo run", tags=["demo"])
    assert demo.previous_training(client, params) is None  # queued, not finished: train again
    # a run from before train wrote a step-0 checkpoint: its entropy curves would not start at 0, train again
    api.set_job(job["id"], status="succeeded", summary={"checkpoints": ["demo@step300", "demo@step600"]})
    assert demo.previous_training(client, params) is None
    checkpoints = {"checkpoints": ["demo@step0", "demo@step300", "demo@step600"]}
    api.set_job(job["id"], summary=checkpoints)
    assert demo.previous_training(client, params)["id"] == job["id"]
    # the demo renames its run when an unfinished one left `demo@step…` checkpoints: still the same run
    assert demo.previous_training(client, {**params, "run_name": "demo-2"})["id"] == job["id"]
    # any other difference (an edited example file) trains again
    assert demo.previous_training(client, {**params, "steps": params["steps"] + 1}) is None
    assert demo.previous_training(client, {**params, "lr": params["lr"] * 2}) is None

    # the same params without the demo tag are someone else's run, not the demo's
    api.set_job(job["id"], status="failed")
    other = client.submit("train", params, name="not the demo")
    api.set_job(other["id"], status="succeeded", summary=checkpoints)
    assert demo.previous_training(client, params) is None
