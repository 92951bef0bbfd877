"""The dashboard in a real browser (headless Chromium) against a real `lmscope up`."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

import pytest
import requests

from lmscope.client import Client

# By package path: a bare `conftest` is whichever conftest.py pytest imported last (tests/worker, tests/kernels, ...).
from tests.conftest import need

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def browse(url: str, *extra: str) -> str:
    """Load `url`, let its scripts run for a few (virtual) seconds, return the DOM or the command's output."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                               "--virtual-time-budget=8000", *extra, url],
                              capture_output=True, text=True, timeout=120)
    return done.stdout


@pytest.mark.slow
def test_dashboard_shows_jobs_progress_summary_and_plots(lmscope_up, tmp_path):
    need(chromium() is not None, "Chromium not installed (apt-get install chromium)")
    url = lmscope_up["LMSCOPE_URL"]
    job = requests.post(f"{url}/v1/jobs", json={"kind": "probe", "params": {"model": "tiny-gpt2"},
                                                "name": "dashboard probe"}, timeout=30).json()
    state = Client(url).wait(job["id"], timeout=120)
    assert state["status"] == "succeeded", state

    # The job list: the row with its kind, name and status.
    dom = browse(f"{url}/", "--dump-dom")
    assert "dashboard probe" in dom and "succeeded" in dom and 'class="job' in dom

    # A job's page: its summary numbers and its plots, loaded through the authenticated API as images.
    dom = browse(f"{url}/#job={job['id']}", "--dump-dom")
    assert f"Job {job['id']}" in dom
    assert '"num_layers": 4' in dom  # the summary, as the API returns it
    plots = [a["name"] for a in requests.get(f"{url}/v1/jobs/{job['id']}/artifacts", timeout=30).json()["items"]
             if a["name"].endswith(".png")]
    assert plots and all(f'alt="{name}"' in dom for name in plots)
    assert "blob:" in dom  # images were fetched and shown, not just linked

    shot = tmp_path / "dashboard.png"
    browse(f"{url}/#job={job['id']}", f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_dashboard_compares_jobs_side_by_side(lmscope_up, tmp_path):
    need(chromium() is not None, "Chromium not installed (apt-get install chromium)")
    url = lmscope_up["LMSCOPE_URL"]
    client = Client(url)
    ids = [client.submit("probe", {"model": model})["id"] for model in ("tiny-gpt2", "tiny-llama")]
    for job_id in ids:
        assert client.wait(job_id, timeout=120)["status"] == "succeeded"
    expected = client.compare(ids, "parameters.by_layer")
    assert expected.params["model"] == {ids[0]: "tiny-gpt2", ids[1]: "tiny-llama"}

    a, b = ids
    dom = browse(f"{url}/#compare={a},{b}&series=parameters.by_layer", "--dump-dom")
    assert 'id="compare-table"' in dom and f"job {a}</th>" in dom and f"job {b}</th>" in dom
    assert "params.model" in dom and "tiny-llama" in dom  # the parameter that differs, side by side
    assert 'data-series="parameters.by_layer"' in dom
    lines = dom.count("<polyline")
    assert lines == sum(len(c.by_job) for c in expected.curves) >= 2  # a line per job and label set
    assert '<option value="parameters.by_layer">' in dom  # the curves both jobs have, to pick from

    shot = tmp_path / "compare.png"
    browse(f"{url}/#compare={a},{b}&series=parameters.by_layer", f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.read_bytes().startswith(b"\x89PNG")
