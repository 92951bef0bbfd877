"""The dashboard in a real browser (headless Chromium) against a real `lmscope up`.

One `lmscope up` and one browser for the whole module; the jobs are made once (`jobs`), tiny ones. The
first tests load pages with `chromium --dump-dom`; the others drive the page over the DevTools protocol
(tests/browser.py) and check what a user relies on against what the API says.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
import subprocess
import tempfile
import time

import numpy as np
import pytest
import requests

from lmscope.client import Client
from lmscope.compare import Y_MEANINGS, labels_text

# By package path: a bare `conftest` is whichever conftest.py pytest imported last (tests/worker, tests/kernels, ...).
from tests.conftest import need, running_lmscope_up
from tests import browser as cdp


pytestmark = pytest.mark.slow

TERMINAL = ("succeeded", "failed", "cancelled")
TINY_SWEEP = {"study": "sumformer", "target": "fig2_poly", "architectures": ["mlp_sumformer"],
              "grid": {"latent_dim": [1, 16], "token_dim": [1], "seq_len": [3], "seed": [0]},
              "train": {"samples": 100, "epochs": 3, "batch_size": 64, "hidden": 8, "depth": 2, "eval_every": 1}}
TINY_TRAIN = {"dataset": "wikitext-2", "run_name": "dash-run", "layers": 1, "width": 16, "heads": 2, "context": 16,
              "vocab_size": 300, "steps": 2, "batch_size": 2, "warmup_steps": 1, "checkpoint_every": 2}


def browse(url: str, *extra: str) -> str:
    """Load `url`, let its scripts run for a few (virtual) seconds, return the DOM or the command's output."""
    with tempfile.TemporaryDirectory(prefix="lmscope-chromium-", ignore_cleanup_errors=True) as profile:
        proc = cdp.launch([*cdp.HEADLESS_FLAGS, "--virtual-time-budget=8000", *extra, url], profile,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, _ = proc.communicate(timeout=120)
        except BaseException:  # the timeout, or an interrupt: kill the whole group, not only the main process
            cdp.kill_group(proc)
            raise
    return stdout


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def up_env(tmp_path_factory):
    """`lmscope up` in its own process for the module (as conftest's `lmscope_up`, shared by every test)."""
    need(cdp.chromium_binary() is not None, "Chromium not installed (apt-get install chromium)")
    with running_lmscope_up(tmp_path_factory.mktemp("dashboard-up")) as env:
        yield env


@pytest.fixture(scope="module")
def url(up_env):
    return up_env["LMSCOPE_URL"]


def submit(url: str, kind: str, params: dict, **extra) -> int:
    r = requests.post(f"{url}/v1/jobs", json={"kind": kind, "params": params, **extra}, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["id"]


@pytest.fixture(scope="module")
def jobs(url):
    """The module's jobs, all finished: two probes, a 2-point sweep, a failed job, a cancelled one, a tiny train run."""
    ids = {
        "a": submit(url, "probe", {"model": "tiny-gpt2"}, name="dash probe A", tags=["dash", "alpha"]),
        "b": submit(url, "probe", {"model": "tiny-llama"}, name="dash probe B", tags=["dash"]),
        "sweep": submit(url, "sweep", TINY_SWEEP, name="dash sweep"),
        "failed": submit(url, "norms", {"model": "tiny-gpt2", "dataset": "wikitext-2", "min_words": 100000}),
        "train": submit(url, "train", TINY_TRAIN),
        "cancelled": submit(url, "probe", {"model": "tiny-gpt2"}, name="dash cancelled"),
    }
    # Queued behind the others: cancelled before it starts.
    assert requests.post(f"{url}/v1/jobs/{ids['cancelled']}/cancel", timeout=30).status_code == 202
    client = Client(url)
    for key, job_id in ids.items():
        state = client.wait(job_id, timeout=180)
        expected = {"failed": "failed", "cancelled": "cancelled"}.get(key, "succeeded")
        assert state["status"] == expected, state
    children = requests.get(f"{url}/v1/jobs?parent={ids['sweep']}", timeout=30).json()["items"]
    assert len(children) == 2
    ids["children"] = sorted(c["id"] for c in children)
    return ids


@pytest.fixture(scope="module")
def browser():
    need(cdp.websocket is not None, "websocket-client not installed (pip install websocket-client)")
    need(cdp.chromium_binary() is not None, "Chromium not installed (apt-get install chromium)")
    with cdp.Browser(1400, 900) as b:
        yield b


@pytest.fixture
def page(browser, url):
    """The module's browser at desktop size; no JS exception may happen during the test."""
    browser.resize(1400, 900)
    seen = len(browser.exceptions)
    yield browser
    assert browser.exceptions[seen:] == [], "JS exceptions in the dashboard"


def api(url, path):
    r = requests.get(url + path, timeout=30)
    r.raise_for_status()
    return r.json()


def open_job(b, url, job_id):
    """Go to the job's address and wait until its page is there. From another page that is a fresh load; from the
    dashboard it is only a hash change (the same page, its hashchange listener shows the job)."""
    b.goto(f"{url}/#job={job_id}")
    wait_job(b, job_id)


def wait_job(b, job_id):
    b.wait(f"document.querySelector('#detail h2')?.textContent.startsWith('Job {job_id} ')")


def list_ids(b):
    return b.js("[...document.querySelectorAll('#jobs tr.job')].map(r => Number(r.dataset.id))")


SET_FILTER = ("(() => {{ const e = document.getElementById('{0}'); e.value = {1}; "
              "e.dispatchEvent(new Event('change')); return true; }})()")


def set_filter(b, control: str, value: str):
    b.js(SET_FILTER.format(control, json.dumps(value)))


def wait_rows(b, want: list[int]):
    b.wait(f"JSON.stringify([...document.querySelectorAll('#jobs tr.job')].map(r => Number(r.dataset.id)))"
           f" === {json.dumps(json.dumps(want, separators=(',', ':')))}")


def fetched(b, part: str) -> int:
    """How many requests with `part` in their URL the page made since the last `performance.clearResourceTimings()`."""
    return b.js(f"performance.getEntriesByType('resource').filter(e => e.name.includes({json.dumps(part)})).length")


def wait_refreshes(b, n=2):
    """Clear the page's request log, then wait until it has refreshed its job list `n` times."""
    b.js("performance.clearResourceTimings(); true")
    b.wait(f"performance.getEntriesByType('resource').filter(e => e.name.includes('/v1/jobs?')).length >= {n}", timeout=15)


def compare_grid_points(b, c1, c2):
    """On a two-point sweep's page: tick both grid points and press its compare button."""
    b.wait("document.querySelectorAll('#children tbody tr').length === 2")
    b.click(f'#children tr[data-id="{c1}"] input.tick')
    b.click(f'#children tr[data-id="{c2}"] input.tick')
    b.click("#detail button.compare-ticked")
    b.wait(f"location.hash === '#compare={c1},{c2}'")
    b.wait("document.getElementById('compare-table')")


# ---------------------------------------------------------------- a plain page load (--dump-dom)

def test_dashboard_shows_jobs_progress_summary_and_plots(url, jobs, tmp_path):
    job = jobs["a"]
    # The job list: the row with its kind, name and status.
    dom = browse(f"{url}/", "--dump-dom")
    row = re.search(rf'<tr class="job[^"]*" data-id="{job}">(.*?)</tr>', dom)
    assert row, dom
    assert "dash probe A" in row[1] and '<span class="status-succeeded">succeeded</span>' in row[1], row[1]

    # A job's page: its summary numbers and its plots, loaded through the authenticated API as images.
    dom = browse(f"{url}/#job={job}", "--dump-dom")
    assert f"Job {job} " in dom
    assert '"num_layers": 4' in dom  # the summary, as the API returns it (the raw JSON under the table)
    plots = [a["name"] for a in api(url, f"/v1/jobs/{job}/artifacts")["items"] if a["name"].endswith(".png")]
    assert plots and all(f'alt="{name}"' in dom for name in plots)
    assert "blob:" in dom  # images were fetched and shown, not just linked

    shot = tmp_path / "dashboard.png"
    browse(f"{url}/#job={job}", f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.read_bytes().startswith(b"\x89PNG")


class DrawnChart(HTMLParser):
    """One chart's SVG: its ticks (pixel, value) per axis and its polylines' points by (job, curve)."""

    def __init__(self, svg: str):
        super().__init__()
        self.ticks: dict[str, list[tuple[float, float]]] = {"x": [], "y": []}
        self.lines: dict[tuple[int, int], list[tuple[float, float]]] = {}
        self._tick = None
        self.feed(svg)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "text" and (a.get("class") or "").startswith("tick "):
            axis = a["class"].split()[1]
            self._tick = (axis, float(a["x"]) if axis == "x" else float(a["y"]) - 4)  # y labels sit 4 px low
        elif tag == "polyline" and "data-job" in a:
            self.lines[int(a["data-job"]), int(a["data-curve"])] = [
                tuple(map(float, p.split(","))) for p in a["points"].split()]

    def handle_data(self, data):
        if self._tick is not None:
            axis, pixel = self._tick
            self.ticks[axis].append((pixel, float(data)))
            self._tick = None

    def data_points(self) -> dict[tuple[int, int], list[tuple[float, float]]]:
        """Each polyline read back into data units through the first and last tick of each axis."""
        def inverse(axis):
            (p0, v0), (p1, v1) = self.ticks[axis][0], self.ticks[axis][-1]
            return lambda p: v0 + (p - p0) * (v1 - v0) / (p1 - p0)

        fx, fy = inverse("x"), inverse("y")
        return {key: [(fx(px), fy(py)) for px, py in pts] for key, pts in self.lines.items()}


def test_dashboard_compares_jobs_side_by_side(url, jobs):
    a, b = jobs["a"], jobs["b"]
    expected = Client(url).compare([a, b], "parameters.by_layer")
    assert expected.params["model"] == {a: "tiny-gpt2", b: "tiny-llama"}

    dom = browse(f"{url}/#compare={a},{b}&series=parameters.by_layer", "--dump-dom")
    assert 'id="compare-table"' in dom and f"job {a}</a></th>" in dom and f"job {b}</a></th>" in dom
    assert "<td>model</td>" in dom and "tiny-llama" in dom  # the parameter that differs, side by side
    assert 'data-series="parameters.by_layer"' in dom
    lines = dom.count("<polyline")
    assert lines == sum(len(c.by_job) for c in expected.curves) >= 2  # a line per job and label set
    # every line is where the API's numbers put it (read back through the axis ticks, to a pixel)
    svg = dom[dom.index('data-series="parameters.by_layer"'):]
    chart = DrawnChart(svg[:svg.index("</svg>")])
    drawn = chart.data_points()
    y_span = max(v for _, v in chart.ticks["y"]) - min(v for _, v in chart.ticks["y"])
    assert set(drawn) == {(job, i) for i, c in enumerate(expected.curves) for job in c.by_job}
    for (job, i), points in drawn.items():
        xs, ys = expected.curves[i].by_job[job]
        assert [round(x) for x, _ in points] == list(xs), (job, i)
        np.testing.assert_allclose([y for _, y in points], ys, atol=y_span / 200)
    assert '<option value="parameters.by_layer">' in dom  # the curves both jobs have, to pick from


# ---------------------------------------------------------------- driving the page

def test_back_button_and_typed_address_show_that_job(page, url, jobs):
    a, b = jobs["a"], jobs["b"]
    open_job(page, url, a)
    page.wait(f"document.querySelector('#jobs tr.job[data-id=\"{b}\"]')")
    page.click(f'#jobs tr.job[data-id="{b}"] td.name')  # a click on the row, not on its link
    wait_job(page, b)
    assert page.js("location.hash") == f"#job={b}"
    assert page.js("document.querySelector('#jobs tr.selected')?.dataset.id") == str(b)

    page.js("history.back()")
    wait_job(page, a)
    assert page.js("document.querySelector('#jobs tr.selected')?.dataset.id") == str(a)
    assert page.text("#detail p b") == "dash probe A"

    page.js(f"location.hash = 'job={jobs['failed']}'")  # as if typed into the address bar
    wait_job(page, jobs["failed"])
    page.js("history.back()")
    wait_job(page, a)


def test_slow_answer_for_a_job_left_behind_is_dropped_and_refreshes_do_not_overlap(page, url, jobs):
    a, b = jobs["a"], jobs["b"]
    open_job(page, url, b)
    # From now on the answer for job A takes 2.5 s, and every list answer 2.5 s (longer than the refresh period).
    page.js(f"""(() => {{
      window.realFetch = window.fetch; window.listsInFlight = 0; window.maxListsInFlight = 0;
      window.fetch = async (path, options) => {{
        const list = String(path).startsWith('/v1/jobs?');
        if (list) {{ listsInFlight++; maxListsInFlight = Math.max(maxListsInFlight, listsInFlight); }}
        try {{
          if (list || String(path) === '/v1/jobs/{a}') await new Promise(r => setTimeout(r, 2500));
          return await realFetch(path, options);
        }} finally {{
          if (list) listsInFlight--;
          if (String(path) === '/v1/jobs/{a}') window.slowAnswered = true;
        }}
      }};
      return true; }})()""")
    # Every title the detail panel shows from now on.
    page.js("window.titles = []; new MutationObserver(() => titles.push(document.querySelector('#detail h2')?.textContent))"
            ".observe(document.getElementById('detail'), { childList: true }); true")
    try:
        page.js(f"location.hash = 'job={a}'")
        page.js(f"new Promise(r => setTimeout(r, 100)).then(() => {{ location.hash = 'job={b}'; }})")
        page.wait("window.slowAnswered === true", timeout=10)  # A's answer has come: it must not replace B's page
        page.js("new Promise(r => setTimeout(() => r(true), 300))")
        wait_job(page, b)
        assert not any(t and t.startswith(f"Job {a} ") for t in page.js("window.titles")), page.js("window.titles")
        assert page.js("location.hash") == f"#job={b}"
        page.wait("window.maxListsInFlight >= 1")
        assert page.js("window.maxListsInFlight") == 1
    finally:
        page.js("window.fetch = window.realFetch; true")


def test_submit_error_stays_next_to_the_form_until_an_edit_and_a_submit_shows_the_new_job(page, url, jobs):
    page.goto(f"{url}/")
    page.js("document.getElementById('submit-box').open = true")
    page.js("""(() => { const set = (id, v) => { document.getElementById(id).value = v; };
                set('kind', 'probe'); set('params', '{"modell": "tiny-gpt2"}'); return true; })()""")
    page.click("#submit")
    page.wait("document.getElementById('submit-error').textContent.length > 0")
    wait_refreshes(page, 2)
    error = page.text("#submit-error")
    assert "params.modell" in error and "did you mean 'model'" in error, error
    assert "fix these fields" not in error  # that detail only repeats the field lines: said once
    wanted = "[...document.querySelectorAll('#submit-form .wanted')].map(e => e.id)"
    assert page.js(wanted) == ["params"]  # the box the error is about is marked
    assert page.js("document.getElementById('submit-error').closest('form') === document.getElementById('submit-form')")
    assert page.js("document.getElementById('submit-error').getBoundingClientRect().height > 0")  # visible
    # A problem whose detail says more than its field message: both are shown.
    page.js("document.getElementById('kind').value = 'norm'")
    page.click("#submit")
    page.wait("document.getElementById('submit-error').textContent.startsWith('Unknown job kind')")
    error = page.text("#submit-error")
    assert "did you mean 'norms'?" in error and error.count("probe") == 1, error  # the kinds listed once
    assert page.js(wanted) == ["kind"]
    page.js("document.getElementById('kind').value = 'probe'")
    # An unknown model: the detail only repeats the field message, which is said once, with its place.
    page.js("""(() => { const p = document.getElementById('params'); p.value = '{"model": "ghost"}'; return true; })()""")
    page.click("#submit")
    page.wait("document.getElementById('submit-error').textContent.startsWith('Unknown model')")
    error = page.text("#submit-error")
    assert error.count("'ghost' is not registered") == 1 and "params.model: model 'ghost'" in error, error

    # Editing a field clears it; a good submit with a name and tags shows the new job.
    page.js("""(() => { const p = document.getElementById('params'); p.value = '{"model": "tiny-gpt2"}';
                p.dispatchEvent(new Event('input', { bubbles: true }));
                document.getElementById('name').value = 'from the form';
                document.getElementById('tags').value = 'ui, form';
                return true; })()""")
    assert page.text("#submit-error") == "" and page.js(wanted) == []
    page.click("#submit")
    page.wait("/^#job=\\d+$/.test(location.hash)")
    new_id = int(page.js("location.hash").split("=")[1])
    job = api(url, f"/v1/jobs/{new_id}")
    assert job["name"] == "from the form" and job["tags"] == ["ui", "form"] and job["kind"] == "probe"
    wait_job(page, new_id)
    assert Client(url).wait(new_id, timeout=120)["status"] == "succeeded"


def choose_kind(b, kind: str):
    """Type a kind into the submit form, as a user does (an input event)."""
    b.js(f"""(() => {{ const k = document.getElementById('kind'); k.value = {json.dumps(kind)};
             k.dispatchEvent(new Event('input', {{ bubbles: true }})); return true; }})()""")


def form_params(b):
    return json.loads(b.js("document.getElementById('params').value"))


def test_choosing_a_kind_fills_in_its_example_and_never_overwrites_written_params(page, url, jobs):
    examples = {k["name"]: k["example"] for k in api(url, "/v1/kinds")["items"] if k["submittable"]}
    assert all(examples.values()), examples
    page.goto(f"{url}/")
    page.js("document.getElementById('submit-box').open = true")
    page.wait("!document.getElementById('use-example').hidden")
    assert page.js("document.getElementById('kind').value") == "probe" and form_params(page) == examples["probe"]
    for kind in ("norms", "entropy", "train", "sweep"):
        choose_kind(page, kind)
        assert form_params(page) == examples[kind], kind
    # Params someone wrote stay when the kind changes; the button fills in the kind's example on demand.
    page.js("""(() => { const p = document.getElementById('params'); p.value = '{"model": "tiny-llama"}';
                p.dispatchEvent(new Event('input', { bubbles: true })); return true; })()""")
    choose_kind(page, "norms")
    assert form_params(page) == {"model": "tiny-llama"}
    assert page.text("#use-example") == "fill in the norms example"
    page.click("#use-example")
    assert form_params(page) == examples["norms"]
    choose_kind(page, "nonsense")  # not a kind: nothing to offer, nothing replaced
    assert page.js("document.getElementById('use-example').hidden") and form_params(page) == examples["norms"]
    # (each example runs: tests/test_cli.py submits them all, as `lmscope kinds KIND` prints them)


def test_params_a_browser_restored_into_the_form_are_not_replaced_by_an_example(page, url, jobs):
    """A reload in a browser that restores form fields (Firefox) puts the user's params back before the page's
    script runs: they are not the page's first text, so the loaded kinds do not replace them."""
    restore = """new MutationObserver((_, observer) => {
        const p = document.getElementById('params');
        if (p) { p.value = '{"model": "restored"}'; observer.disconnect(); }
    }).observe(document, { childList: true, subtree: true });"""
    added = page.page("Page.addScriptToEvaluateOnNewDocument", source=restore)["identifier"]
    try:
        page.goto(f"{url}/")
        page.wait("!document.getElementById('use-example').hidden")  # the kinds are loaded
        assert form_params(page) == {"model": "restored"}
    finally:
        page.page("Page.removeScriptToEvaluateOnNewDocument", identifier=added)
    # without a restore, the form starts from the kind's example as the server gives it, written out
    page.goto(f"{url}/")
    page.wait("!document.getElementById('use-example').hidden")
    assert page.js("document.getElementById('params').value") == '{\n  "model": "tiny-gpt2"\n}'


def test_cancel_that_comes_too_late_says_so(page, url, jobs):
    a = jobs["a"]
    open_job(page, url, a)
    # The page of a job that was running when it was drawn: its Cancel button, the job has finished since.
    page.js(f"""(() => {{ const c = cancelControls({{ id: {a}, status: 'running', cancel_requested: false }});
                document.getElementById('detail').append(c); return true; }})()""")
    page.click("#cancel")
    page.wait("document.getElementById('cancel-error')?.textContent.includes('finished')")
    assert "Job already finished" in page.text("#cancel-error")
    assert requests.post(f"{url}/v1/jobs/{a}/cancel", timeout=30).status_code == 409  # what the API says


def test_a_queued_job_says_what_it_waits_behind(page, url, jobs):
    open_job(page, url, jobs["a"])
    text = "progressText({status: 'queued', progress: null, timings: {}, queue: %s})"
    assert page.js(text % "{ahead: 1, running: 2}") == "queued behind 1 job · 2 running"
    assert page.js(text % "{ahead: 0, running: 1}") == "queued behind 0 jobs · 1 running"
    assert page.js(text % "undefined") == "queued, waiting for a worker"  # a list row has no queue field
    assert (page.js(text % "{ahead: 0, running: 0, worker_stopped: 'the GPU is unusable; restart'}")
            == "queued; no worker takes jobs: the GPU is unusable; restart")
    # with a broker and no Celery worker consuming its queue (the API's census): the job waits for one
    assert (page.js(text % "{ahead: 2, running: 0, workers: 0}")
            == "queued; no worker takes jobs from the queue: it waits until one starts")
    assert page.js(text % "{ahead: 2, running: 1, workers: 1}") == "queued behind 2 jobs · 1 running"
    # submitted while the broker was down: the job (or a sweep's grid points) waits for the broker to answer
    assert (page.js(text % "{ahead: 2, running: 1, unsent: true}")
            == "queued; not handed to the broker yet: it is sent when the broker answers")
    sweep = ("progressText({status: 'running', progress: {done: 1, total: 3, stage: 'children'}, timings: {}, "
             "children_unsent: %d})")
    assert page.js(sweep % 2) == ("1/3 grid points done · 2 grid points not handed to the broker yet: they are sent "
                                  "when the broker answers")
    assert page.js(sweep % 1) == ("1/3 grid points done · 1 grid point not handed to the broker yet: it is sent when "
                                  "the broker answers")
    assert page.js(sweep % 0) == "1/3 grid points done"
    # a grid point's params in a sweep's failed/cancelled table: a column each, not one cell of cut JSON
    table = page.js("""(() => { const t = objectsTable([{job_id: 3, status: "cancelled", params: {architecture: "mlp_sumformer",
                                 latent_dim: 2}}, {job_id: 4, status: "failed", error: "boom", params: {architecture: "transformer",
                                 latent_dim: 4, features: 8}}], "x");
        return [...t.querySelectorAll("tr")].map(r => [...r.children].map(c => c.textContent)); })()""")
    assert table == [["job_id", "status", "params.architecture", "params.latent_dim", "error", "params.features"],
                     ["3", "cancelled", "mlp_sumformer", "2", "–", "–"], ["4", "failed", "transformer", "4", "boom", "8"]]
    # a stage that says its own count is not followed by it again; one that does not gets it
    running = "progressText({status: 'running', progress: {done: 928, total: 1200, stage: %r}, timings: {run_seconds: 12}})"
    assert page.js(running % "epoch 928/1200, val error 0.312") == "epoch 928/1200, val error 0.312 · running for 12s"
    assert page.js(running % "measure") == "measure · 928/1200 · running for 12s"
    assert page.js(running % "epoch 1928/12000") == "epoch 1928/12000 · 928/1200 · running for 12s"  # not its count
    # nothing ahead, nothing running: it is next (`behind 0 jobs · 0 running` read as a contradiction)
    assert page.js(text % "{ahead: 0, running: 0}") == "queued, next: a worker takes it in a moment"


def test_a_sweep_point_requeued_as_another_starts_is_refetched(page, url, jobs):
    """A running sweep's page refetches all its points only when its counts by status move; point 1 put back in
    the queue (a lost worker) as point 2 starts leaves them as they were. The running points the server names
    then differ from the rows', which refetches every point, instead of showing point 1 running for ever."""
    open_job(page, url, jobs["a"])
    setup = ("const rows = new JobRows(document.createElement('tbody'), ['status']);"
             "rows.update([{id: 1, status: 'running'}, {id: 2, status: 'queued'}, {id: 3, status: 'succeeded'}]);")
    moved = "(() => { %s return runningPointsMoved(rows, %s); })()"
    assert page.js(moved % (setup, "[{id: 2, status: 'running'}]")) is True  # the same count, another point
    assert page.js(moved % (setup, "[]")) is True
    assert page.js(moved % (setup, "[{id: 1, status: 'running'}]")) is False  # only its progress moved


def test_finished_job_page_is_not_rebuilt_by_refreshes(page, url, jobs):
    job = jobs["a"]
    open_job(page, url, job)
    page.wait("document.querySelectorAll('.plots img').length > 0")
    page.js("document.getElementById('summary-table').dataset.mark = 'kept'; "
            "document.querySelector('#detail details').open = true; true")
    wait_refreshes(page, 2)
    assert page.js("document.getElementById('summary-table').dataset.mark") == "kept"
    assert page.js("document.querySelector('#detail details').open") is True
    assert fetched(page, "/artifacts") == 0 and fetched(page, f"/v1/jobs/{job}") == 0  # nothing refetched


def test_finished_jobs_say_how_they_ended_and_show_files_as_downloads(page, url, jobs, tmp_path):
    done = api(url, f"/v1/jobs/{jobs['a']}")
    open_job(page, url, jobs["a"])
    live = page.text("#progress-text")
    assert live.startswith("finished in") and done["progress"]["stage"] not in live
    assert page.js(f"Object.keys(imageCache).some(k => k.startsWith('{jobs['a']}/'))")  # its plots, held as blobs
    # each plot is shrunk to the panel; a click opens that same image at full size, in a tab of its own
    page.wait("[...document.querySelectorAll('.plots img')].every(i => i.complete && i.naturalWidth > 0)")
    links = page.js("[...document.querySelectorAll('.plots img')].map(i => [i.parentElement.tagName, "
                    "i.parentElement.target, i.parentElement.href === i.src])")
    assert links and all(link == ["A", "_blank", True] for link in links), links
    # a plot shrunk to the column says so under its name (a wide figure's print is small); one shown whole does not
    hints = "[...document.querySelectorAll('.plots img')].map(i => [i.naturalWidth > i.clientWidth + 1, " \
            "(i.parentElement.previousElementSibling.querySelector('.hint') || {}).textContent || ''])"
    page.wait(f"{hints}.some(([shrunk, hint]) => shrunk && hint)")  # said once the page has laid the plot out
    shown = page.js(hints)
    assert all(("click it for full size" in hint) == shrunk for shrunk, hint in shown), shown
    assert any(shrunk for shrunk, _ in shown), shown

    open_job(page, url, jobs["cancelled"])
    assert page.text("#progress-text").startswith("cancelled")
    assert page.js("Object.keys(imageCache)") == []  # a job with no plots: the previous job's are let go
    assert not page.js("!!document.getElementById('cancel')")

    failed = api(url, f"/v1/jobs/{jobs['failed']}")
    open_job(page, url, jobs["failed"])
    assert page.text("#progress-text").startswith("failed") and failed["error"]["message"] in page.text("#job-error")
    # The whole message is in view, its advice at the end included: it wraps in its box, no sideways scroll.
    assert failed["error"]["message"].endswith("lower min_words or pick a larger dataset")
    assert page.js("(e => e.scrollWidth <= e.clientWidth && e.getBoundingClientRect().height > 40)($('job-error'))")
    assert "Plots" not in page.js("[...document.querySelectorAll('#detail h3')].map(h => h.textContent)")

    # A running job that was asked to stop says so, not its last stage.
    text = page.js("progressText({ status: 'running', cancel_requested: true, progress: { stage: 'ETA 23m32s' }, timings: {} })")
    assert text.startswith("cancelling") and "ETA" not in text

    # Files that are not plots: links that download through the API; with no token a plain link (the
    # browser streams the file), with one a fetch that sends it (as a blob).
    files = [a for a in api(url, f"/v1/jobs/{jobs['train']}/artifacts")["items"] if not a["name"].endswith(".png")]
    open_job(page, url, jobs["train"])
    page.wait("document.querySelectorAll('#files a.file').length > 0")
    # in the API's order, but the numbers in names by value: checkpoints/step-2 before step-10
    natural = sorted((f["name"] for f in files), key=lambda n: [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", n))])
    assert page.js("[...document.querySelectorAll('#files a.file')].map(a => a.textContent)") == natural
    assert page.js("['step-100/a', 'step-50/b', 'step-50/a', 'step-7', 'c'].sort(naturalOrder)") == \
        ["c", "step-7", "step-50/a", "step-50/b", "step-100/a"]
    wanted = {f["name"].split("/")[-1]: f["size"] for f in files if f["name"].endswith(("config.json", "tokenizer.json"))}
    for name, token in (("config.json", ""), ("tokenizer.json", "any-token")):
        folder = tmp_path / (token or "no-token")
        folder.mkdir()
        page.send("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(folder))
        page.js(f"$('token').value = {json.dumps(token)}")
        page.click(f'#files a.file[download="{name}"]')
        deadline = time.monotonic() + 15
        while not (folder / name).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (folder / name).stat().st_size == wanted[name]
    page.js("$('token').value = ''")


def test_sweep_points_open_link_back_and_compare(page, url, jobs):
    sweep, (c1, c2) = jobs["sweep"], jobs["children"]
    open_job(page, url, sweep)
    page.wait("document.querySelectorAll('#children tbody tr').length === 2")
    assert page.js("[...document.querySelectorAll('#children thead th')].map(t => t.textContent)")[1:] == \
        ["id", "status", "name", "best val error"]
    # in grid order (the API lists newest first)
    assert page.js("[...document.querySelectorAll('#children tbody tr')].map(r => Number(r.dataset.id))") == [c1, c2]
    # Its compare button counts the ticked grid points only (what it compares), not a job ticked in the list.
    page.click(f'#jobs tr.job[data-id="{jobs["a"]}"] input.tick')
    page.click(f'#children tr[data-id="{c1}"] input.tick')
    assert page.text("#detail button.compare-ticked") == "Compare ticked grid points (1)"
    assert page.text("#compare") == "Compare ticked jobs (2)"
    page.click(f'#jobs tr.job[data-id="{jobs["a"]}"] input.tick')
    page.click(f'#children tr[data-id="{c1}"] input.tick')
    # Each finished grid point's result, as its summary has it.
    for child in (c1, c2):
        best = api(url, f"/v1/jobs/{child}")["summary"]["best_val_error"]
        assert float(page.text(f'#children tr[data-id="{child}"] td.result')) == pytest.approx(best, rel=1e-5)
    # Finished, its results come first and the grid points after them (a 64-point table pushed them far down).
    headings = page.js("[...document.querySelectorAll('#detail h3')].map(h => h.textContent)")
    assert headings.index("Summary") < headings.index("Plots") < [h.startswith("Grid points") for h in headings].index(True)
    # The sweep's best line per configuration: a table, a column per field.
    best = api(url, f"/v1/jobs/{sweep}")["summary"]["best"]
    assert page.js("[...document.querySelectorAll('#summary-table-best thead th')].map(t => t.textContent)") == list(best[0])
    cells = page.js("[...document.querySelectorAll('#summary-table-best tbody tr')].map(r => [...r.cells].map(c => c.textContent))")
    assert len(cells) == len(best)
    for row, line in zip(cells, best):
        assert row[list(line).index("architecture")] == line["architecture"]
        assert float(row[list(line).index("best_val_error")]) == pytest.approx(line["best_val_error"], rel=1e-5)
    page.click(f'#children tr[data-id="{c2}"] td.name')
    wait_job(page, c2)
    child = api(url, f"/v1/jobs/{c2}")
    assert page.text("#detail p b") == child["name"]
    page.click("#parent-link")
    wait_job(page, sweep)
    compare_grid_points(page, c1, c2)
    page.js("for (const b of document.querySelectorAll('input.tick:checked')) b.click(); true")  # untick for later tests


def test_compare_legend_colours_names_and_differences(page, url, jobs):
    c1, c2 = jobs["children"]
    expected = api(url, f"/v1/compare?jobs={c1},{c2}&series=val_error")
    page.goto(f"{url}/#compare={c1},{c2}&series=val_error")
    page.wait("document.querySelectorAll('svg.chart polyline').length > 0")
    legend = page.js("""[...document.querySelectorAll('svg.chart text.legend')].map(t => ({
        job: t.dataset.job, fill: getComputedStyle(t).fill, text: t.textContent,
        title: t.querySelector('title').textContent,
        inside: t.getBoundingClientRect().right <= t.ownerSVGElement.getBoundingClientRect().right + 0.5 }))""")
    strokes = page.js("""Object.fromEntries([...document.querySelectorAll('svg.chart polyline')].map(
        p => [p.querySelector('title').textContent.split(' ')[1], getComputedStyle(p).stroke]))""")
    names = {str(j["id"]): j["name"] for j in expected["jobs"]}
    assert [entry["job"] for entry in legend] == [str(c1), str(c2)]
    for entry in legend:
        assert entry["fill"] == strokes[entry["job"]], (entry, strokes)
        assert names[entry["job"]] in entry["text"] and entry["inside"]  # the whole name, d'=16 included
    assert len(set(strokes.values())) == 2
    ticks = page.js("document.querySelectorAll('svg.chart text.tick').length")
    assert ticks >= 6  # more than min and max on each axis
    # curves a few ulps apart (a converged loss) or at 1e17 still get a few ticks, not an endless loop
    assert 1 <= page.js("ticks(2.3025850929940455, 2.302585092994046).length") <= 16
    assert 1 <= page.js("ticks(1e17, 1e17 + 64).length") <= 16
    assert page.js("ticks(0, 1)") == [0, 0.2, 0.4, 0.6, 0.8, 1]
    # x says what it is, as the compare API names it for this series: the epoch
    assert {s["x_meaning"] for s in expected["series"]} == {"epoch"}
    # y says what it is, as `lmscope compare --plot` does (the chart's title names the series)
    assert page.js("[...document.querySelectorAll('svg.chart text.axis-title')].map(t => t.textContent)") == \
        ["epoch", Y_MEANINGS["val_error"]]

    # The rows where the jobs differ stand out; the others do not.
    differs = page.js("""Object.fromEntries([...document.querySelectorAll('#compare-table tbody tr')]
        .filter(r => r.cells.length > 1).map(r => [r.cells[0].textContent, r.classList.contains('differs')]))""")
    for key, values in {**expected["params"], **expected["summary"]}.items():
        assert differs[key] == (len({json.dumps(v) for v in values.values()}) > 1), key
    headers = page.js("[...document.querySelectorAll('#compare-table tbody th')].map(t => t.textContent)")
    assert any(h.startswith("parameters") for h in headers) and any(h.startswith("results") for h in headers)

    # log y: the same curves, on a log scale, from the address.
    page.click("#logy")
    page.wait("location.hash.endsWith('&logy=1')")
    page.wait("[...document.querySelectorAll('svg.chart text.axis-title')].some(t => t.textContent.endsWith('(log)'))")
    assert page.js("document.querySelectorAll('svg.chart polyline').length") == sum(len(s["jobs"]) for s in expected["series"])

    # Jobs with no curve in common: said so.
    assert api(url, f"/v1/compare?jobs={jobs['a']},{c1}")["shared_series"] == []
    page.goto(f"{url}/#compare={jobs['a']},{c1}")
    page.wait("document.getElementById('no-shared')")
    assert "no series" in page.text("#no-shared")
    # ... and a series in the address that only one has: drawn, and said to be only theirs
    page.goto(f"{url}/#compare={jobs['a']},{c1}&series=val_error")
    page.wait("document.querySelector('svg.chart polyline') && document.getElementById('no-shared')")
    assert page.text("#no-shared").endswith("below, val_error of the jobs that have it.")


def test_compare_shows_values_apart_past_six_digits_in_full(page, url):
    """A row marked as differing whose six-digit values read the same (float sums rounded on another thread
    count) shows the values in full; rows apart within six digits keep six."""
    page.goto(f"{url}/")
    cells = page.js("""(() => {
        const doc = { jobs: [{ id: 1, kind: "norms", status: "succeeded" }, { id: 2, kind: "norms", status: "succeeded" }],
                      params: {}, summary: { mean: { 1: 2.4453125, 2: 2.4453126 }, pct: { 1: 40, 2: 55.5 },
                                             same: { 1: 0.1, 2: 0.1 } },
                      series: [], shared_series: [], missing: [] };
        const table = comparePage(doc, { ids: [1, 2] })[1].querySelector('table');
        return Object.fromEntries([...table.querySelectorAll('tbody tr')].filter(r => r.cells.length > 1)
            .map(r => [r.cells[0].textContent, [...r.cells].slice(1).map(c => c.textContent)]));
    })()""")
    assert cells["mean"] == ["2.4453125", "2.4453126"]
    assert cells["pct"] == ["40", "55.5"] and cells["same"] == ["0.1", "0.1"]


def test_a_comparison_opened_from_its_address_ticks_its_jobs(page, url, jobs):
    """The boxes and the button's count say what is compared, also when the comparison came from a link."""
    a, b = jobs["a"], jobs["b"]

    def ticked():
        return page.js("[...document.querySelectorAll('#jobs input.tick:checked')].map(x => Number(x.dataset.id))"
                       ".sort((x, y) => x - y)")

    page.goto(f"{url}/")
    page.wait(f"document.querySelector('#jobs input.tick[data-id=\"{b}\"]')")
    page.click("#compare")  # nothing ticked: an error, which the comparison below replaces
    assert page.text("#compare-error") == "tick at least two jobs to compare"
    page.js(f"location.hash = 'compare={a},{b}'; true")
    page.wait("document.getElementById('compare-table')")
    assert ticked() == sorted([a, b]) and page.text("#compare") == "Compare ticked jobs (2)"
    assert page.text("#compare-error") == ""
    sweep = jobs["sweep"]  # another comparison typed into the address bar: its jobs instead
    page.js(f"location.hash = 'compare={b},{sweep}'; true")
    page.wait(f"document.querySelector('#jobs input.tick[data-id=\"{sweep}\"]')?.checked")
    assert ticked() == sorted([b, sweep]) and page.text("#compare") == "Compare ticked jobs (2)"
    # A comparison made from some of the ticked boxes (a sweep's grid points) leaves the others ticked.
    c1, c2 = jobs["children"]
    page.js(f"location.hash = 'job={sweep}'; true")
    wait_job(page, sweep)
    compare_grid_points(page, c1, c2)
    assert ticked() == sorted([b, sweep]) and page.text("#compare") == "Compare ticked jobs (4)"
    # untick everything (the grid points' boxes are gone with the sweep's page) for later tests
    page.js("ticked.clear(); for (const x of document.querySelectorAll('input.tick')) x.checked = false; "
            "updateCompareButtons(); true")


def test_a_list_of_several_users_jobs_says_whose_each_is(page, url, jobs, up_env):
    """`lmscope up` is single-user (its caller is the admin `local`): a job of another user, written into
    its database here, shows the user column; without it the column is hidden."""
    from sqlalchemy import delete

    from lmscope.config import Settings
    from lmscope.db.engine import make_engine, make_sessionmaker
    from lmscope.db.models import Job, User, utcnow

    def user_column():
        return page.js("getComputedStyle(document.querySelector('#jobs-table th.user')).display !== 'none'")

    page.goto(f"{url}/")
    page.wait(f"document.querySelector('#jobs tr.job[data-id=\"{jobs['a']}\"]')")
    assert not user_column()
    engine = make_engine(Settings.from_env(up_env).database_url)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as s:
        bob = User(name="bob-dash")
        s.add(bob)
        s.flush()
        job = Job(user_id=bob.id, kind="probe", params={"model": "tiny-gpt2"}, status="succeeded", tags=[],
                  created_at=utcnow(), finished_at=utcnow(), max_attempts=1)
        s.add(job)
        s.flush()
        bobs = job.id
    try:
        page.wait(f"document.querySelector('#jobs tr.job[data-id=\"{bobs}\"]')")
        page.wait("getComputedStyle(document.querySelector('#jobs-table th.user')).display !== 'none'")
        owners = page.js("Object.fromEntries([...document.querySelectorAll('#jobs tr.job')].map("
                         "r => [r.dataset.id, r.querySelector('td.user').textContent]))")
        assert owners[str(bobs)] == "bob-dash" and owners[str(jobs["a"])] == "local"
    finally:
        with sessions.begin() as s:
            s.execute(delete(Job).where(Job.id == bobs))
            s.execute(delete(User).where(User.name == "bob-dash"))
        engine.dispose()
    page.wait(f"!document.querySelector('#jobs tr.job[data-id=\"{bobs}\"]')")
    assert not user_column()


CHART_TICKS = """(() => {
  const jobs = [{ id: 1, name: "a" }], curve = (x, y) => [{ name: "s", labels: {}, x_meaning: "step", jobs: { "1": { x, y } } }];
  const drawn = svg => { document.body.append(svg); const r = {
    x: [...svg.querySelectorAll("text.tick.x")].map(t => t.textContent),
    y: [...svg.querySelectorAll("text.tick.y")].map(t => t.textContent),
    yLeft: Math.min(...[...svg.querySelectorAll("text.tick.y")].map(t => t.getBoundingClientRect().left)),
    titleRight: Math.max(...[...svg.querySelectorAll("text.axis-title")].slice(1).map(t => t.getBoundingClientRect().right)),
    yTitle: [...svg.querySelectorAll("text.axis-title")].slice(1).map(t => t.textContent) };
    svg.remove(); return r; };
  return { one: drawn(chart("s", curve([0], [2.5], ), jobs)),
           narrow: drawn(chart("s", curve([0, 1, 2], [2.548665, 2.548668, 2.548672]), jobs)),
           logNarrow: drawn(chart("s", curve([1, 2, 3], [5.31, 5.45, 5.58]), jobs, { logy: true })),
           longTitle: drawn(chart("inner_loss.mean", [{ ...curve([0, 1, 2], [2.548665, 2.548668, 2.548672])[0], name: "inner_loss.mean" }], jobs)),
           legend: (() => { const svg = chart("s", curve([0, 1], [1, 2]), jobs, { params: { loss_filter: { "1": null } } });
                            return [...svg.querySelectorAll("text.legend")].map(t => t.firstChild.nodeValue); })(),
           absent: (() => { const two = [{ id: 1, name: "a" }, { id: 2, name: null }];
                            const both = [{ name: "s", labels: {}, x_meaning: "step", jobs: { "1": { x: [0, 1], y: [1, 2] }, "2": { x: [0, 1], y: [2, 3] } } }];
                            const svg = chart("s", both, two, { params: { loss_filter: { "1": 1 }, train_job: { "2": 7 } } });
                            return [...svg.querySelectorAll("text.legend")].map(t => t.firstChild.nodeValue); })(),
           styles: (() => { const svg = chart("s", [{ ...curve([0, 1], [1, 2])[0] },
                                                    { ...curve([0, 1], [2, 3])[0], labels: { step: 10 } }], jobs);
                            return [...svg.querySelectorAll("text.legend-style")].map(t => t.textContent); })() };
})()"""


def test_chart_ticks_are_distinct_round_and_clear_of_the_axis_title(page, url):
    """A range a few millionths wide gets labels that differ (at six digits they all read 2.54867); a log axis
    over less than a factor of 2 gets round values; one x value gets its own tick, not −1 and 1 around it;
    long y labels leave the rotated y title room."""
    page.goto(f"{url}/")
    page.wait("typeof chart === 'function' && document.getElementById('detail')")
    got = page.js(CHART_TICKS)
    assert got["one"]["x"] == ["0"]
    # y says what it is (lmscope knows inner_loss): in two lines where one does not fit the plot's height
    assert " ".join(got["longTitle"]["yTitle"]) == Y_MEANINGS["inner_loss"] and len(got["longTitle"]["yTitle"]) == 2
    assert got["narrow"]["yTitle"] == ["s"]  # a series lmscope does not know: its name
    for case in ("narrow", "logNarrow", "longTitle"):
        assert len(set(got[case]["y"])) == len(got[case]["y"]) >= 3, got[case]
        assert got[case]["yLeft"] > got[case]["titleRight"], got[case]  # the labels stay right of the title
    assert {float(v) for v in got["logNarrow"]["y"]} <= {5.3, 5.35, 5.4, 5.45, 5.5, 5.55, 5.6}
    assert page.js("tickLabels([2.548665, 2.54867, 2.548675], 6)") == ["2.548665", "2.54867", "2.548675"]
    # a parameter that differs by being null is named null, as `lmscope compare --plot` names it; one the job
    # does not have (another kind's) is left out of its line
    assert got["legend"] == ["job 1 · a (loss_filter=null)"]
    assert got["absent"] == ["job 1 · a (loss_filter=1)", "job 2 (train_job=7)"]
    assert got["styles"] == ["(no step)", "step=10"]  # a curve without the varying label is named, not blank


def test_a_chart_line_stops_at_a_missing_value_and_at_what_a_log_axis_cannot_draw(page, url):
    """A NaN (null in the results) and, on a log axis, a value ≤ 0 end a line: the next drawable point starts
    another, instead of one line bridging the gap as if values were there (an entropy histogram's empty bins
    on a log y axis read as a flat density)."""
    page.goto(f"{url}/")
    page.wait("typeof chart === 'function' && document.getElementById('detail')")
    got = page.js("""(() => {
      const jobs = [{ id: 1, name: "a" }], one = (x, y) => [{ name: "s", labels: {}, x_meaning: "x", jobs: { "1": { x, y } } }];
      const runs = (svg) => [...svg.querySelectorAll("polyline")].map(p => p.getAttribute("points").split(" ").length);
      return { nan: runs(chart("s", one([0, 1, 2, 3, 4], [1, 2, null, 3, 4]), jobs)),
               log: runs(chart("s", one([0, 1, 2, 3, 4, 5], [1, 2, 0, 0, 3, 4]), jobs, { logy: true })),
               linear: runs(chart("s", one([0, 1, 2, 3, 4, 5], [1, 2, 0, 0, 3, 4]), jobs)) };
    })()""")
    assert got == {"nan": [2, 2], "log": [2, 2], "linear": [6]}


# `k=v, ...` as `lmscope compare --plot` writes labels (tests/test_compare.py checks it by hand): the
# dashboard's JS must write them the same way
label_text = labels_text


def test_one_jobs_many_curves_each_have_a_style_of_their_own(page, url):
    """A job's page draws its own curves (an attention study's rel_error: method x layer, 8 on tiny-gpt2): no colour
    is needed for the job, so each curve gets one (then a dash), and the legend shows each curve in its style."""
    page.goto(f"{url}/")
    page.wait("typeof chart === 'function'")
    drawn = page.js("""(() => {
        const curves = [...Array(11).keys()].map(i => ({ name: "rel_error", x_meaning: "k",
            labels: { method: i < 6 ? "performer" : "linformer", layer: i % 6, seed_count: 1 },
            jobs: { "7": { x: [8, 16, 32], y: [i + 1, i + 2, i + 3] } } }));
        const svg = chart("rel_error", curves, [{ id: 7, name: "one study" }]);
        document.getElementById('detail').append(svg);
        const look = e => [getComputedStyle(e).stroke, getComputedStyle(e).strokeDasharray];
        return { lines: [...svg.querySelectorAll('polyline')].map(p => [Number(p.dataset.curve), ...look(p)]),
                 legend: [...svg.querySelectorAll('text.legend-style')].map(t => [Number(t.dataset.curve), t.textContent,
                                                                                   ...look(t.previousElementSibling)]),
                 subtitle: svg.querySelector('text.subtitle').textContent,
                 jobSwatch: svg.querySelector('text.legend').previousElementSibling?.tagName ?? null }; })()""")
    styles = {i: (stroke, dash) for i, stroke, dash in drawn["lines"]}
    assert sorted(styles) == list(range(11)) and len(set(styles.values())) == 11, drawn["lines"]
    legend = {i: (text, (stroke, dash)) for i, text, stroke, dash in drawn["legend"]}
    assert legend == {i: (f"method={'performer' if i < 6 else 'linformer'}, layer={i % 6}", styles[i]) for i in range(11)}
    assert drawn["subtitle"] == "seed_count=1"  # what all of them share, once
    # the job's legend line has no swatch: no curve is drawn in a job colour here
    assert drawn["jobSwatch"] != "line"
    # Two jobs keep a colour each (their curves a dash each): colour says which job.
    two = page.js("""(() => {
        const curves = [0, 1].map(i => ({ name: "e", labels: { layer: i }, x_meaning: "x",
            jobs: { "7": { x: [1, 2], y: [1, i] }, "8": { x: [1, 2], y: [2, i] } } }));
        const svg = chart("e", curves, [{ id: 7 }, { id: 8 }]);
        document.getElementById('detail').append(svg);
        return [...svg.querySelectorAll('polyline')].map(p => [p.dataset.job, getComputedStyle(p).stroke]); })()""")
    by_job = {}
    for job, stroke in two:
        by_job.setdefault(job, set()).add(stroke)
    assert all(len(s) == 1 for s in by_job.values()) and len({s.pop() for s in by_job.values()}) == 2, two
    # A comparison where one job alone has the series: its curves keep its colour (its legend line's), dashed apart.
    alone = page.js("""(() => {
        const curves = [0, 1, 2].map(i => ({ name: "e", labels: { layer: i }, x_meaning: "x",
            jobs: { "8": { x: [1, 2], y: [1, i] } } }));
        const svg = chart("e", curves, [{ id: 7 }, { id: 8 }]);
        document.getElementById('detail').append(svg);
        const legend = svg.querySelector('text.legend[data-job="8"]').previousElementSibling;
        return { strokes: [...svg.querySelectorAll('polyline')].map(p => getComputedStyle(p).stroke),
                 dashes: [...svg.querySelectorAll('polyline')].map(p => getComputedStyle(p).strokeDasharray),
                 job8: getComputedStyle(legend).stroke }; })()""")
    assert set(alone["strokes"]) == {alone["job8"]} and len(set(alone["dashes"])) == 3, alone
    # Two entropy jobs of 16 layer × head curves each: more curves than dashes, which left them nameless. Each curve
    # gets a colour and dash (the same in both jobs) and its legend entry; the jobs are told apart by width.
    many = page.js("""(() => {
        const curves = [...Array(16).keys()].map(i => ({ name: "entropy.mean", labels: { layer: i >> 2, head: i % 4 },
            x_meaning: "training step", jobs: { "7": { x: [0, 1], y: [3, i / 8] }, "8": { x: [0, 1], y: [3, i / 9] } } }));
        const svg = chart("entropy.mean", curves, [{ id: 7 }, { id: 8 }]);
        document.getElementById('detail').append(svg);
        const look = e => [getComputedStyle(e).stroke, getComputedStyle(e).strokeDasharray];
        const r = { lines: [...svg.querySelectorAll('polyline')].map(p => [p.dataset.job, Number(p.dataset.curve), ...look(p),
                                                                            Number(p.getAttribute('stroke-width'))]),
                    legend: [...svg.querySelectorAll('text.legend-style')].map(t => [t.textContent, ...look(t.previousElementSibling)]),
                    jobs: [...svg.querySelectorAll('line.job-width')].map(l => Number(l.getAttribute('stroke-width'))) };
        svg.remove(); return r; })()""")
    looks = {}
    for job, curve, stroke, dash, width in many["lines"]:
        looks.setdefault(curve, set()).add((stroke, dash))
    assert sorted(looks) == list(range(16)) and all(len(v) == 1 for v in looks.values())
    looks = {curve: look.pop() for curve, look in looks.items()}
    assert len(set(looks.values())) == 16
    widths = {job: {w for j, _, _, _, w in many["lines"] if j == job} for job in ("7", "8")}
    assert widths == {"7": {many["jobs"][0]}, "8": {many["jobs"][1]}} and many["jobs"][0] < many["jobs"][1]
    # the legend names each curve in the look its lines have
    assert many["legend"] == [[f"layer={i >> 2}, head={i % 4}", *looks[i]] for i in range(16)]


def test_compare_tells_each_jobs_curves_apart(page, url, jobs):
    # The sweep's mean curves against one of its grid points: val_error per latent_dim, the point has one of them.
    sweep, c1 = jobs["sweep"], jobs["children"][0]
    expected = api(url, f"/v1/compare?jobs={sweep},{c1}&series=val_error")
    curves = expected["series"]
    assert [sorted(c["jobs"]) for c in curves] == [sorted([str(sweep), str(c1)]), [str(sweep)]]
    keys = list(dict.fromkeys(k for c in curves for k in c["labels"]))
    varying = [k for k in keys if len({json.dumps(c["labels"].get(k)) for c in curves}) > 1]
    assert varying == ["latent_dim"]
    page.goto(f"{url}/#compare={sweep},{c1}&series=val_error")
    page.wait("document.querySelectorAll('svg.chart polyline').length === 3")
    lines = page.js("""[...document.querySelectorAll('svg.chart polyline')].map(p => ({
        job: p.dataset.job, curve: Number(p.dataset.curve), stroke: getComputedStyle(p).stroke,
        dash: getComputedStyle(p).strokeDasharray }))""")
    # A colour per job and a line style per curve (label set), whichever job draws it; all different.
    for key, look in (("job", "stroke"), ("curve", "dash")):
        seen = {}
        for line in lines:
            seen.setdefault(line[key], set()).add(line[look])
        assert all(len(v) == 1 for v in seen.values()), (key, lines)
        assert len({v.pop() for v in seen.values()}) == len(seen) == 2, (key, lines)
    # The legend names what varies, a line in each curve's style; what the curves share is said once, under the title.
    legend = page.js("""[...document.querySelectorAll('svg.chart text.legend-style')].map(t => ({ text: t.textContent,
        dash: getComputedStyle(t.previousElementSibling).strokeDasharray }))""")
    assert [e["text"] for e in legend] == [label_text(c["labels"], varying) for c in curves]
    assert [e["dash"] for e in legend] == [next(ln["dash"] for ln in lines if ln["curve"] == i) for i in range(2)]
    shared = [k for k in keys if k not in varying]
    assert page.text("svg.chart text.subtitle") == label_text(curves[0]["labels"], shared)
    # a Sumformer has no features (k): the label is null, and the chart leaves it out instead of "features=-"
    assert curves[0]["labels"]["features"] is None and "features" not in page.text("svg.chart text.subtitle")
    # x is the epoch: whole-number ticks only.
    xs = page.js("[...document.querySelectorAll('svg.chart text.tick.x')].map(t => t.textContent)")
    assert len(xs) >= 2 and all(re.fullmatch(r"\d+", x) for x in xs), xs

    # log x beside log y, both in the address
    page.click("#logx")
    page.wait(f"location.hash === '#compare={sweep},{c1}&series=val_error&logx=1'")
    page.wait("document.querySelector('svg.chart text.axis-title')?.textContent === 'epoch (log)'")
    page.click("#logy")
    page.wait(f"location.hash === '#compare={sweep},{c1}&series=val_error&logx=1&logy=1'")
    page.wait("[...document.querySelectorAll('svg.chart text.axis-title')].map(t => t.textContent).join()"
              f" === 'epoch (log),{Y_MEANINGS['val_error']} (log)'")
    assert page.js("$('logx').checked && $('logy').checked")


def test_finished_job_draws_a_picked_series_loaded_only_then(page, url, jobs):
    sweep, c1 = jobs["sweep"], jobs["children"][0]
    results = api(url, f"/v1/jobs/{sweep}/results")["series"]
    load(page, f"{url}/#job={sweep}")
    page.wait("document.querySelectorAll('#job-series option').length > 1")
    assert page.js("[...document.querySelectorAll('#job-series option')].map(o => o.value)")[1:] == \
        sorted({s["name"] for s in results})
    asked = page.js("performance.getEntriesByType('resource').map(e => e.name).filter(n => n.includes('/results'))")
    assert asked == [f"{url}/v1/jobs/{sweep}/results?series="], asked  # the names, no curve

    set_filter(page, "job-series", "best_val_error")
    page.wait(f"location.hash === '#job={sweep}&series=best_val_error'")
    page.wait("document.querySelectorAll('#job-chart svg polyline').length > 0")
    assert page.js("document.querySelectorAll('#job-chart svg polyline').length") == \
        len([s for s in results if s["name"] == "best_val_error"])
    # x named as the compare API names it
    x_meaning = api(url, f"/v1/compare?jobs={sweep},{c1}&series=best_val_error")["series"][0]["x_meaning"]
    assert page.text("#job-chart text.axis-title") == x_meaning == "latent dimension d′"

    # log x (d′ is read log-log): 1, 2, 5, 10 — as far apart as their ratios — and no refetch.
    page.js("performance.clearResourceTimings(); true")
    page.click("#logx")
    page.wait(f"location.hash === '#job={sweep}&series=best_val_error&logx=1'")
    page.wait("document.querySelector('#job-chart text.axis-title')?.textContent.endsWith('(log)')")
    at = dict(page.js("[...document.querySelectorAll('#job-chart text.tick.x')].map(t => [t.textContent, Number(t.getAttribute('x'))])"))
    assert {"1", "2", "5", "10"} <= set(at), at
    assert at["2"] > at["1"] and at["2"] - at["1"] == pytest.approx(at["10"] - at["5"], abs=0.2), at
    assert fetched(page, "/results") == 0

    # The address draws it again after a reload.
    load(page, f"{url}/#job={sweep}&series=best_val_error&logx=1")
    page.wait("document.querySelector('#job-chart text.axis-title')?.textContent === 'latent dimension d′ (log)'")
    assert page.js("$('job-series').value === 'best_val_error' && $('logx').checked && !$('logy').checked")


def test_a_series_of_more_points_than_a_page_draws_its_first_page_and_says_where_the_rest_are(page, url, up_env):
    """A job whose curves of one name pass the results API's page (250,000 points): the chart draws the
    curves of the first page and says how to get them all, instead of loading a hundred megabytes."""
    from sqlalchemy import create_engine, insert

    from lmscope.api.results import RESULT_PAGE_POINTS
    from lmscope.db.models import Series

    job_id = submit(url, "probe", {"model": "tiny-gpt2"}, name="dash many points")
    assert Client(url).wait(job_id, timeout=180)["status"] == "succeeded"
    n = RESULT_PAGE_POINTS // 2  # three curves: two fit the first page
    engine = create_engine(f"sqlite:///{up_env['LMSCOPE_DATA_DIR']}/lmscope.db")
    with engine.begin() as conn:
        conn.execute(insert(Series), [dict(job_id=job_id, name="big.curve", labels={"layer": layer},
                                           x=list(range(n)), y=[float(layer)] * n) for layer in range(3)])
    engine.dispose()
    load(page, f"{url}/#job={job_id}&series=big.curve")
    page.wait("document.getElementById('curves-more')", timeout=60)
    assert page.js("document.querySelectorAll('#job-chart svg polyline').length") == 2
    assert page.text("#curves-more") == (f"The first 2 curves of big.curve; the others are more points than a page "
                                         f"holds. All of them: lmscope results {job_id} --series big.curve")
    assert len(Client(url).results(job_id, "big.curve")["series"]) == 3  # the client joins the pages


def test_a_running_sweeps_points_are_fetched_again_only_when_one_starts_or_ends(page, url, up_env, jobs):
    """A running sweep's page: between refreshes where no point started or ended it asks only for the running
    points (whose progress moves), not the whole list (2 MB for 2,000 points, every 2 s); a point that ends
    brings the whole list once. The sweep is written into the server's database, its running point with a
    heartbeat ahead so that the reaper leaves it be."""
    from datetime import timedelta

    from sqlalchemy import create_engine, delete, update
    from sqlalchemy.orm import Session

    from lmscope.db.models import Job, utcnow

    engine = create_engine(f"sqlite:///{up_env['LMSCOPE_DATA_DIR']}/lmscope.db")
    now = utcnow()
    with Session(engine) as session, session.begin():
        user_id = session.get(Job, jobs["a"]).user_id
        parent = Job(user_id=user_id, kind="sweep", params=TINY_SWEEP, status="running", waiting_children=True,
                     created_at=now, started_at=now, name="dash frozen sweep")
        session.add(parent)
        session.flush()
        point = dict(user_id=user_id, kind="sumformer_fit", params={}, parent_id=parent.id, created_at=now)
        running = Job(**point, status="running", started_at=now, heartbeat_at=now + timedelta(days=1),
                      progress_done=1, progress_total=10, name="running point")
        done = [Job(**point, status="succeeded", started_at=now, finished_at=now, name=f"done {i}") for i in range(2)]
        session.add_all([running, *done])
        session.flush()
        sweep, point_id = parent.id, running.id
    try:
        open_job(page, url, sweep)
        page.wait("document.querySelectorAll('#children tbody tr').length === 3")
        wait_refreshes(page, 3)
        asked = page.js("performance.getEntriesByType('resource').map(e => e.name)"
                        f".filter(n => n.includes('parent={sweep}'))")
        assert asked and all("status=running" in n for n in asked), asked  # the running point only

        with Session(engine) as session, session.begin():  # its progress moves: the row follows
            session.execute(update(Job).where(Job.id == point_id).values(progress_done=7))
        page.wait(f"document.querySelector('#children tr[data-id=\"{point_id}\"] td.status')"
                  "?.textContent.includes('7/10')", timeout=15)

        with Session(engine) as session, session.begin():  # it ends: the whole list, once
            session.execute(update(Job).where(Job.id == point_id).values(status="succeeded", finished_at=utcnow()))
        page.js("performance.clearResourceTimings(); true")
        page.wait(f"document.querySelector('#children tr[data-id=\"{point_id}\"] td.status')"
                  "?.textContent.startsWith('succeeded')", timeout=15)
        whole = page.js("performance.getEntriesByType('resource').map(e => e.name)"
                        f".filter(n => n.includes('parent={sweep}') && !n.includes('status='))")
        assert len(whole) == 1, whole
    finally:
        with Session(engine) as session, session.begin():  # gone again: the module's other tests list its jobs
            session.execute(delete(Job).where(Job.parent_id == sweep))
            session.execute(delete(Job).where(Job.id == sweep))
        engine.dispose()


def test_filters_show_exactly_what_the_api_lists(page, url, jobs):
    page.goto(f"{url}/")
    page.wait("document.querySelectorAll('#jobs tr.job').length > 0 && document.querySelectorAll('#f-kind option').length > 1")

    def check(control, value, query):
        set_filter(page, control, value)
        want = [j["id"] for j in api(url, "/v1/jobs?" + query)["items"]]
        wait_rows(page, want)
        return want

    probes = check("f-kind", "probe", "kind=probe&parent=none")
    assert jobs["a"] in probes and jobs["sweep"] not in probes
    check("f-kind", "", "parent=none")
    assert check("f-status", "failed", "status=failed&parent=none") == [jobs["failed"]]
    # several states at once, as the API takes them: everything not ended, everything ended
    ended = check("f-status", "succeeded,failed,cancelled", "status=succeeded,failed,cancelled&parent=none")
    active = check("f-status", "queued,running", "status=queued,running&parent=none")
    every = [j["id"] for j in api(url, "/v1/jobs?parent=none")["items"]]
    assert jobs["failed"] in ended and sorted(ended + active, reverse=True) == every
    assert "status=queued%2Crunning" in page.js("location.hash")  # the address keeps it (a load of it: above)
    check("f-status", "", "parent=none")
    tagged = check("f-tag", "alpha", "tag=alpha&parent=none")
    assert tagged == [jobs["a"]]
    check("f-tag", "", "parent=none")
    points = check("f-kind", "sumformer_fit", "kind=sumformer_fit")  # a sweep's points, by kind
    assert points == sorted(jobs["children"], reverse=True)
    check("f-kind", "", "parent=none")
    # Created time and tags are in the rows.
    row = f'#jobs tr.job[data-id="{jobs["a"]}"]'
    assert page.js(f"[...document.querySelectorAll('{row} .tag')].map(t => t.textContent)") == ["dash", "alpha"]
    assert page.js(f"document.querySelector('{row} td.created').textContent").endswith(("ago", "just now"))
    # The list fits its panel at desktop width: no sideways scroll.
    assert page.js("(() => { const s = document.querySelector('#list-panel .scroll'); return s.scrollWidth <= s.clientWidth; })()")


def test_list_says_what_each_job_ran_on_and_why_it_failed(page, url, jobs):
    page.resize(1000, 800)  # a laptop window: every column in view, "created" too
    load(page, f"{url}/")
    page.wait(f"document.querySelector('#jobs tr.job[data-id=\"{jobs['failed']}\"] td.on')?.textContent")
    on = {key: page.text(f'#jobs tr.job[data-id="{jobs[key]}"] td.on') for key in ("a", "b", "failed", "train", "sweep")}
    assert on == {"a": "tiny-gpt2", "b": "tiny-llama", "failed": "tiny-gpt2 · wikitext-2", "train": "wikitext-2",
                  "sweep": "sumformer study · fig2_poly"}
    # Several models, a train job's checkpoints (a link to that job), a grid point.
    assert page.js("subject({ kind: 'entropy', params: { models: ['r@step1', 'r@step2', 'r@step3'], dataset: 'd' } })"
                   ".join('')") == "r@step1 … r@step3 (3 models) · d"
    assert page.js("(([a, , d]) => [a.getAttribute('href'), a.textContent, d])"
                   "(subject({ kind: 'entropy', params: { train_job: 7, dataset: 'd' } }))") == ["#job=7", "train job 7", "d"]
    assert page.js("subject({ kind: 'sumformer_fit', params: { architecture: 'poly_sumformer', target: 'fig2_poly' } })"
                   ".join('')") == "poly_sumformer · fig2_poly"

    # A failed row says why on hover, and to a screen reader; other rows have no tooltip.
    error = api(url, f"/v1/jobs/{jobs['failed']}")["error"]
    row = f'#jobs tr.job[data-id="{jobs["failed"]}"]'
    assert page.js(f"document.querySelector('{row}').title") == f"{error['type']}: {error['message']}"
    assert error["message"] in page.text(f"{row} td.status")
    assert page.js(f"document.querySelector('#jobs tr.job[data-id=\"{jobs['a']}\"]').hasAttribute('title')") is False

    # At 1000 px the table fits its panel: no sideways scroll, every "created" cell inside it.
    assert page.js("""(() => { const s = document.querySelector('#list-panel .scroll'), box = s.getBoundingClientRect();
        return s.scrollWidth <= s.clientWidth && [...document.querySelectorAll('#jobs td.created')].every(
            c => c.textContent && c.getBoundingClientRect().right <= box.right + 0.5); })()""")



# ---------------------------------------------------------------- the list's filters in the address

def filters(b) -> dict:
    return b.js("({ kind: $('f-kind').value, status: $('f-status').value, tag: $('f-tag').value })")


def load(b, address: str):
    """A fresh page load of `address` (not a same-page hash change), as a reload or a link from elsewhere is."""
    b.goto("about:blank")
    b.goto(address)


def test_filters_in_the_address_set_the_controls_and_the_list(page, url, jobs):
    load(page, f"{url}/#kind=probe&status=succeeded&tag=dash")
    want = [j["id"] for j in api(url, "/v1/jobs?kind=probe&status=succeeded&tag=dash&parent=none")["items"]]
    assert want == [jobs["b"], jobs["a"]]
    wait_rows(page, want)
    assert filters(page) == {"kind": "probe", "status": "succeeded", "tag": "dash"}
    assert page.js("location.hash") == "#kind=probe&status=succeeded&tag=dash"
    assert page.text("#list-info") == "2 jobs"
    assert page.js("document.querySelector('#detail p')?.textContent").startswith("Select a job")

    # What cannot be a filter is left out, and the address then says what the list shows.
    load(page, f"{url}/#kind=no-such-kind&status=exploded&tag=alpha")
    wait_rows(page, [jobs["a"]])
    assert filters(page) == {"kind": "", "status": "", "tag": "alpha"}
    page.wait("location.hash === '#tag=alpha'")
    assert page.js("document.querySelector('#detail p')?.textContent").startswith("Select a job")

    # Several states, as the API takes them: a group in any order is that group's choice, another list of
    # states a choice of its own; a list with a state that is none, or a name objects have, is no filter.
    load(page, f"{url}/#status=running%2Cqueued")
    wait_rows(page, [j["id"] for j in api(url, "/v1/jobs?status=queued,running&parent=none")["items"]])
    assert filters(page)["status"] == "queued,running"
    assert page.js("$('f-status').selectedOptions[0].textContent") == "not ended (queued, running)"
    page.wait("location.hash === '#status=queued%2Crunning'")
    load(page, f"{url}/#status=cancelled,failed")
    want = [j["id"] for j in api(url, "/v1/jobs?status=failed,cancelled&parent=none")["items"]]
    assert jobs["failed"] in want
    wait_rows(page, want)
    assert page.js("$('f-status').selectedOptions[0].textContent") == "failed, cancelled"
    for wrong in ("failed,exploded", "toString", "constructor"):
        load(page, f"{url}/#status={wrong}&tag=alpha")
        wait_rows(page, [jobs["a"]])
        assert filters(page)["status"] == "" and page.js("$('f-status').selectedIndex") == 0
        page.wait("location.hash === '#tag=alpha'")

    # A kind of a sweep's points: the list waits for the kinds, so it never asks for top-level jobs only.
    load(page, f"{url}/#kind=sumformer_fit")
    wait_rows(page, sorted(jobs["children"], reverse=True))
    assert filters(page)["kind"] == "sumformer_fit"
    asked = page.js("performance.getEntriesByType('resource').map(e => e.name).filter(n => n.includes('/v1/jobs?'))")
    assert asked and all("kind=sumformer_fit" in n and "parent=none" not in n for n in asked), asked

    # With a job's address beside them (a reload of a job opened from a filtered list).
    load(page, f"{url}/#job={jobs['failed']}&status=failed")
    wait_job(page, jobs["failed"])
    wait_rows(page, [jobs["failed"]])
    assert filters(page) == {"kind": "", "status": "failed", "tag": ""}
    assert page.js("document.querySelector('#jobs tr.selected')?.dataset.id") == str(jobs["failed"])


def test_changing_a_filter_rewrites_the_address_in_place(page, url, jobs):
    a = jobs["a"]
    load(page, f"{url}/")
    page.wait("document.querySelectorAll('#jobs tr.job').length > 0 && document.querySelectorAll('#f-kind option').length > 1")
    steps = page.js("history.length")
    set_filter(page, "f-kind", "probe")
    page.wait("location.hash === '#kind=probe'")
    set_filter(page, "f-status", "succeeded")
    page.wait("location.hash === '#kind=probe&status=succeeded'")
    # A tag being typed filters nothing until it is entered: "da" on the way to "dash" would empty the list.
    page.js("$('f-tag').value = 'da'; $('f-tag').dispatchEvent(new Event('input')); true")
    wait_refreshes(page)
    assert page.js("location.hash") == "#kind=probe&status=succeeded"
    wait_rows(page, [j["id"] for j in api(url, "/v1/jobs?kind=probe&status=succeeded&parent=none")["items"]])
    set_filter(page, "f-tag", "  dash ")
    page.wait("location.hash === '#kind=probe&status=succeeded&tag=dash'")
    wait_rows(page, [jobs["b"], a])
    page.click(f'#jobs tr.job[data-id="{a}"] .tag:last-child')  # the tag `alpha` in a row: the list of that tag
    page.wait("location.hash === '#kind=probe&status=succeeded&tag=alpha'")
    wait_rows(page, [a])
    assert page.js("history.length") == steps  # no step for the back button per filter

    # On a job's page the filters ride along beside the job; cleared, they leave the address.
    page.click(f'#jobs tr.job[data-id="{a}"] td.name')
    wait_job(page, a)
    assert page.js("location.hash") == f"#job={a}&kind=probe&status=succeeded&tag=alpha"
    set_filter(page, "f-kind", "")
    page.wait(f"location.hash === '#job={a}&status=succeeded&tag=alpha'")
    set_filter(page, "f-status", "")
    set_filter(page, "f-tag", "")
    page.wait(f"location.hash === '#job={a}'")
    wait_job(page, a)
    set_filter(page, "f-tag", "alpha")
    page.click("header h1 a")  # the list, nothing selected: still filtered
    page.wait("location.hash === '#tag=alpha' && document.querySelector('#detail p')?.textContent.startsWith('Select a job')")
    set_filter(page, "f-tag", "")
    page.wait("location.hash === '' && location.href.endsWith('/')")


def test_back_from_a_job_or_a_comparison_returns_to_the_filtered_list(page, url, jobs):
    a, b = jobs["a"], jobs["b"]
    listed = {"kind": "probe", "status": "succeeded", "tag": ""}
    want = [j["id"] for j in api(url, "/v1/jobs?kind=probe&status=succeeded&parent=none")["items"]]
    assert a in want and b in want and jobs["cancelled"] not in want
    load(page, f"{url}/#kind=probe&status=succeeded")
    wait_rows(page, want)

    # A row opens its job; the list stays as it was, and the filters are on the job's address.
    page.click(f'#jobs tr.job[data-id="{a}"] td.name')
    wait_job(page, a)
    assert page.js("location.hash") == f"#job={a}&kind=probe&status=succeeded"
    assert filters(page) == listed and list_ids(page) == want
    # So does the job's id link (a plain `#job=N` link).
    page.click(f'#jobs tr.job[data-id="{b}"] td.id a')
    wait_job(page, b)
    assert page.js("location.hash") == f"#job={b}&kind=probe&status=succeeded"

    # Another list typed into the address bar, then back, twice: each page with its own filters.
    page.js("location.hash = 'status=failed'")
    wait_rows(page, [jobs["failed"]])
    assert filters(page) == {"kind": "", "status": "failed", "tag": ""}
    page.js("history.back()")
    wait_job(page, b)
    wait_rows(page, want)
    assert filters(page) == listed
    page.js("history.back()")
    wait_job(page, a)
    page.js("history.back()")
    page.wait("location.hash === '#kind=probe&status=succeeded'")
    page.wait("document.querySelector('#detail p')?.textContent.startsWith('Select a job')")
    wait_rows(page, want)
    assert filters(page) == listed
    assert page.js("document.querySelector('#jobs tr.selected')") is None

    # A reload of a job's page keeps the list's filters, and back from it is the filtered list.
    page.click(f'#jobs tr.job[data-id="{a}"] td.name')
    wait_job(page, a)
    page.js("window.beforeReload = true; location.reload(); true")
    page.wait(f"!window.beforeReload && document.querySelector('#detail h2')?.textContent.startsWith('Job {a} ')")
    wait_rows(page, want)
    assert filters(page) == listed
    page.js("history.back()")
    page.wait("location.hash === '#kind=probe&status=succeeded'")
    wait_rows(page, want)
    assert filters(page) == listed

    # A comparison of ticked jobs from the filtered list, and back.
    page.click(f'#jobs tr.job[data-id="{a}"] input.tick')
    page.click(f'#jobs tr.job[data-id="{b}"] input.tick')
    page.click("#compare")
    lo, hi = sorted((a, b))
    page.wait(f"location.hash === '#compare={lo},{hi}&kind=probe&status=succeeded'")
    page.wait("document.getElementById('compare-table')")
    assert filters(page) == listed
    page.js("for (const b of document.querySelectorAll('input.tick:checked')) b.click(); true")  # untick for later tests
    page.js("history.back()")
    page.wait("location.hash === '#kind=probe&status=succeeded'")
    page.wait("document.querySelector('#detail p')?.textContent.startsWith('Select a job')")
    wait_rows(page, want)
    assert filters(page) == listed

def test_narrow_screen_has_one_column(page, url, jobs):
    page.resize(390, 844, mobile=True)
    open_job(page, url, jobs["sweep"])
    page.wait("document.querySelectorAll('#children tbody tr').length === 2")
    sizes = page.js("""({ doc: document.documentElement.scrollWidth, view: innerWidth,
                         detail: document.getElementById('detail').getBoundingClientRect().width })""")
    assert sizes["detail"] >= 300 and sizes["doc"] <= sizes["view"], sizes
    # The job list fits too: no sideways scroll inside its panel.
    assert page.js("(() => { const s = document.querySelector('#list-panel .scroll'); return s.scrollWidth <= s.clientWidth; })()")
    c1, c2 = jobs["children"]
    page.goto(f"{url}/#compare={c1},{c2}&series=val_error")
    page.wait("document.querySelectorAll('svg.chart polyline').length > 0")
    assert page.js("document.documentElement.scrollWidth <= innerWidth")

    # A tap on a row (not its id link) in the list above the hint: the job's page is scrolled to once it is drawn
    # (the hint alone was too short to scroll to).
    page.goto(f"{url}/")
    page.wait(f'document.querySelector(\'#jobs tr.job[data-id="{jobs["train"]}"]\')')
    page.click(f'#jobs tr.job[data-id="{jobs["train"]}"] td.status')
    wait_job(page, jobs["train"])
    page.wait("Math.abs(document.getElementById('detail').getBoundingClientRect().top) < 2")
    # A job opened while the server does not answer is not scrolled to later, when it does (the user has moved on).
    page.goto(f"{url}/")
    page.wait("document.querySelectorAll('#jobs tr.job').length > 0")
    page.js("window.realFetch = window.fetch; window.fetch = () => Promise.reject(new TypeError('Failed to fetch')); true")
    try:
        page.js(f"location.hash = '#job={jobs['a']}'; true")
        page.wait("document.getElementById('conn').textContent.includes('server unreachable')", timeout=10)
    finally:
        page.js("window.fetch = window.realFetch; true")
    page.js("window.scrollTo(0, 0); true")
    wait_job(page, jobs["a"])
    wait_refreshes(page, 2)
    assert page.js("window.scrollY") == 0


def test_a_list_of_sweep_points_fits_its_panel(page, url, jobs):
    """Filtered to a sweep point kind (long names: sumformer_fit, mlp_sumformer) the list keeps every column in its
    panel, on a laptop and a wide screen; the kind the filter names is not repeated on every row."""
    for width in (1000, 1400):
        page.resize(width, 900)
        page.goto(f"{url}/#kind=sumformer_fit")
        wait_rows(page, sorted(jobs["children"], reverse=True))
        assert page.js("(s => s.scrollWidth <= s.clientWidth)(document.querySelector('#list-panel .scroll'))"), width
        assert page.js("getComputedStyle(document.querySelector('#jobs-table th.kind')).display") == "none"
    set_filter(page, "f-kind", "")
    page.wait("getComputedStyle(document.querySelector('#jobs-table th.kind')).display !== 'none'")


def test_unreachable_server_is_said_and_clears(page, url, jobs):
    open_job(page, url, jobs["a"])
    page.js("window.realFetch = window.fetch; window.fetch = () => Promise.reject(new TypeError('Failed to fetch')); true")
    try:
        page.wait("document.getElementById('conn').textContent.includes('server unreachable')", timeout=10)
        assert page.js("document.getElementById('list-panel').classList.contains('stale')")
    finally:
        page.js("window.fetch = window.realFetch; true")
    page.wait("document.getElementById('conn').textContent === ''", timeout=10)
    assert not page.js("document.getElementById('list-panel').classList.contains('stale')")


def test_more_pages_through_the_list(page, url, jobs):
    # 55 jobs tagged `bulk`, cancelled while queued (nothing runs): more than the first page of 50.
    session = requests.Session()
    bulk = []
    for _ in range(55):
        job = session.post(f"{url}/v1/jobs", json={"kind": "probe", "params": {"model": "tiny-gpt2"}, "tags": ["bulk"]},
                           timeout=30).json()["id"]
        session.post(f"{url}/v1/jobs/{job}/cancel", timeout=30)
        bulk.append(job)
    first = api(url, "/v1/jobs?tag=bulk&parent=none&limit=50")
    assert first["next_page_token"]
    page.goto(f"{url}/")
    set_filter(page, "f-tag", "bulk")
    page.wait("document.querySelectorAll('#jobs tr.job').length === 50 && !document.getElementById('more').hidden")
    assert list_ids(page) == [j["id"] for j in first["items"]]
    page.click("#more")
    page.wait("document.querySelectorAll('#jobs tr.job').length === 55 && document.getElementById('more').hidden")
    assert list_ids(page) == sorted(bulk, reverse=True)
    client = Client(url)
    for job in bulk:  # leave no job behind for the worker
        client.wait(job, timeout=120)


def test_docs_page_links_back_and_renders_code(page, url):
    page.goto(f"{url}/")
    page.click("header nav a[href='/docs']")
    page.wait("location.pathname === '/docs' && document.querySelectorAll('#ops h2').length > 0")
    headings = page.js("[...document.querySelectorAll('#ops h2')].map(h => h.innerText)")
    assert "OpenAPI" in headings and "Openapi" not in headings
    assert page.js("document.body.innerText.includes('🔒')") is False
    assert page.js("[...document.querySelectorAll('#ops td code, #ops p code')].some(c => c.textContent === 'none')")
    assert "`" not in page.js("[...document.querySelectorAll('#ops td')].map(t => t.textContent).join(' ')")
    page.click("a[href='/']")
    page.wait("location.pathname === '/' && document.getElementById('jobs')")


def test_a_jobs_page_links_its_train_job(page, url):
    """An entropy job over a train job's checkpoints: its Parameters link that job, as the list's "on" column does."""
    page.goto(f"{url}/")
    page.wait("typeof buildJobPage === 'function'")
    link = page.js("""(async () => {
        const job = { id: 99999, kind: "entropy", status: "queued", created_at: new Date().toISOString(),
                      params: { train_job: 7, dataset: "wikitext-2", num_segments: 4, models: null } };
        const { parts } = await buildJobPage(job, () => false);
        const table = parts.find(p => p && p.querySelector && p.querySelector('#params-table'));
        const a = table.querySelector('a');
        const models = [...table.querySelectorAll('tr')].find(r => r.cells[0].textContent === 'models').cells[1].textContent;
        return [a.getAttribute('href'), a.textContent, table.querySelectorAll('a').length, models]; })()""")
    # a null parameter reads "null", as in the compare view (it is a value: all checkpoints of the train job)
    assert link == ["#job=7", "7", 1, "null"]


def test_long_values_wrap_inside_their_panels(page, url, jobs):
    """Two sweeps compared: their grids (lists and objects) wrap in the compare table, which fits the panel (as
    compact JSON the second job sat 1700 px to the right). A checkpoint name (no space to wrap at) in the job
    list's "on" column keeps "created" inside the panel at laptop widths."""
    load(page, f"{url}/")
    assert page.js('fmt({ latent_dim: [1, 2], seq_len: [3] })') == '{"latent_dim": [1, 2], "seq_len": [3]}'
    # floats to 6 significant digits in lists too, as `lmscope compare` writes them
    assert page.js('fmt([0.44765678567140726, 2, { v: 1e-7 / 3 }])') == '[0.447657, 2, {"v": 3.33333e-8}]'
    grid = lambda d: {"latent_dim": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "token_dim": list(range(1, 11)),
                      "seq_len": [3], "seed": [0, d]}
    doc = {"jobs": [{"id": 1, "kind": "sweep", "name": None, "status": "succeeded"},
                    {"id": 2, "kind": "sweep", "name": None, "status": "succeeded"}],
           "params": {"grid": {"1": grid(1), "2": grid(2)}}, "summary": {}, "shared_series": [], "series": [], "missing": []}
    fits = page.js("""(doc => { const parts = comparePage(doc, { ids: [1, 2], series: null, logx: false, logy: false });
        const box = el("div", { id: "probe-box" }, ...parts); $("detail").append(box);
        const s = box.querySelector(".scroll"), ok = s.scrollWidth <= s.clientWidth; box.remove(); return ok; })(%s)"""
                   % json.dumps(doc))
    assert fits
    long_subject = {"id": 999999, "kind": "entropy", "status": "succeeded", "tags": [], "created_at": "2026-01-01T00:00:00Z",
                    "params": {"models": ["audit-run-with-a-long-name@step60", "audit-run-with-a-long-name@step600"],
                               "dataset": "wikitext-2"}}
    for width in (1000, 1100, 1330, 1390):
        page.resize(width, 900)
        assert page.js("""(job => { listRows.update([job]);
            const s = document.querySelector('#list-panel .scroll'), box = s.getBoundingClientRect();
            return s.scrollWidth <= s.clientWidth && [...document.querySelectorAll('#jobs td.created')].every(
                c => c.getBoundingClientRect().right <= box.right + 0.5); })(%s)""" % json.dumps(long_subject)), width


# ---------------------------------------------------------------- last: these add jobs to the module's service
# (the list and filter tests above count the module's jobs)

def answer_confirm(b, answer: bool):
    """The page's `confirm()` answers `answer` from now on, and keeps what it was asked in `window.asked`."""
    b.js(f"window.asked = []; window.confirm = q => {{ asked.push(q); return {json.dumps(answer)}; }}; true")


def artifact_bytes(url, job_ids) -> int:
    return sum(a["size"] for i in job_ids for a in api(url, f"/v1/jobs/{i}/artifacts")["items"])


def test_delete_asks_first_then_goes_back_to_the_list_and_says_what_went(page, url, jobs):
    """A finished job's "Delete…" says what goes and asks; on OK the job is deleted (410 since), the page is the
    list with its filters, a note says what went and the bytes freed, and its box is no longer ticked; its
    address then says when it was deleted."""
    job_id = submit(url, "probe", {"model": "tiny-gpt2"}, name="dash to delete")
    assert Client(url).wait(job_id, timeout=180)["status"] == "succeeded"
    files = api(url, f"/v1/jobs/{job_id}/artifacts")["items"]
    assert files
    count = f"{len(files)} file" + ("" if len(files) == 1 else "s")
    load(page, f"{url}/#job={job_id}&status=succeeded")
    size = page.js(f"bytes({artifact_bytes(url, [job_id])})")  # as the page writes sizes
    wait_job(page, job_id)
    page.wait(f"document.querySelector('#jobs tr.job[data-id=\"{job_id}\"]')")
    for ticked in (job_id, jobs["a"]):
        page.click(f'#jobs tr.job[data-id="{ticked}"] input.tick')
    assert page.text("#compare") == "Compare ticked jobs (2)"

    answer_confirm(page, False)  # the user thinks again: nothing goes
    page.click("#delete-job")
    assert page.js("window.asked") == [f"Delete job {job_id} (probe · dash to delete) with its series and "
                                       f"{count} ({size})? This cannot be undone."]
    assert requests.get(f"{url}/v1/jobs/{job_id}", timeout=30).status_code == 200
    assert page.js("location.hash") == f"#job={job_id}&status=succeeded" and page.text("#delete-error") == ""

    answer_confirm(page, True)
    page.click("#delete-job")
    page.wait("location.hash === '#status=succeeded'")
    page.wait("document.querySelector('#detail p')?.textContent.startsWith('Select a job')")
    assert page.text("#list-note") == f"Deleted job {job_id} (freed {size})."
    assert page.js("$('list-note').getBoundingClientRect().height > 0")
    gone = requests.get(f"{url}/v1/jobs/{job_id}", timeout=30)
    assert gone.status_code == 410 and gone.json()["type"] == "https://lmscope.dev/problems/job-deleted"
    wait_rows(page, [j["id"] for j in api(url, "/v1/jobs?status=succeeded&parent=none")["items"]])
    assert job_id not in list_ids(page) and filters(page) == {"kind": "", "status": "succeeded", "tag": ""}
    assert page.js("[...ticked]") == [jobs["a"]] and page.text("#compare") == "Compare ticked jobs (1)"
    page.click(f'#jobs tr.job[data-id="{jobs["a"]}"] input.tick')  # untick for later tests

    # Its address: what the API says of it, no error; the note about the deletion goes with the list.
    page.js(f"location.hash = 'job={job_id}'; true")
    page.wait("document.getElementById('job-deleted')")
    detail = gone.json()["detail"]
    assert detail.startswith(f"job {job_id} (probe) was deleted on ")
    assert page.text("#job-deleted") == "J" + detail[1:] and page.text("#detail h2") == f"Job {job_id}"
    assert not page.js("document.querySelector('#detail .error')")
    assert page.js("$('list-note').hidden")
    load(page, f"{url}/#job={job_id}")  # and so does a fresh load of it
    page.wait("document.getElementById('job-deleted')")


def test_deleting_a_sweep_deletes_its_grid_points(page, url, jobs):
    sweep = submit(url, "sweep", TINY_SWEEP, name="dash sweep to delete")
    assert Client(url).wait(sweep, timeout=180)["status"] == "succeeded"
    points = sorted(c["id"] for c in api(url, f"/v1/jobs?parent={sweep}")["items"])
    assert len(points) == 2
    files = len(api(url, f"/v1/jobs/{sweep}/artifacts")["items"])
    count = f"{files} file" + ("" if files == 1 else "s")
    load(page, f"{url}/#job={sweep}")
    size = page.js(f"bytes({artifact_bytes(url, [sweep])})")
    freed = page.js(f"bytes({artifact_bytes(url, [sweep, *points])})")  # the grid points' files too
    wait_job(page, sweep)
    page.wait("document.querySelectorAll('#children tbody tr').length === 2")
    page.click(f'#children tr[data-id="{points[0]}"] input.tick')
    answer_confirm(page, True)
    page.click("#delete-job")
    assert page.js("window.asked") == [f"Delete job {sweep} (sweep · dash sweep to delete) with its series and "
                                       f"{count} ({size}), and its 2 grid points with theirs? This cannot be undone."]
    page.wait("location.hash === ''")
    page.wait("document.querySelector('#detail p')?.textContent.startsWith('Select a job')")
    assert page.text("#list-note") == f"Deleted job {sweep} and its 2 grid points (freed {freed})."
    for job_id in (sweep, *points):
        assert requests.get(f"{url}/v1/jobs/{job_id}", timeout=30).status_code == 410, job_id
    assert api(url, f"/v1/jobs?parent={sweep}")["items"] == []
    page.wait(f"!document.querySelector('#jobs tr.job[data-id=\"{sweep}\"]')")
    assert page.js("ticked.size") == 0 and page.text("#compare") == "Compare ticked jobs (0)"
    page.js(f"location.hash = 'job={points[1]}'; true")  # a grid point's address: deleted with its sweep
    page.wait(f"document.getElementById('job-deleted')?.textContent.startsWith('Job {points[1]} (sumformer_fit) was deleted')")


def test_no_delete_on_a_job_not_ended_nor_on_a_grid_point(page, url, up_env, jobs):
    """A running job has Cancel, not Delete (the API refuses it: job-active); a grid point goes with its sweep
    (job-in-sweep). The running job is written into the server's database, its heartbeat ahead so that the
    reaper leaves it be."""
    from datetime import timedelta

    from sqlalchemy import create_engine, delete
    from sqlalchemy.orm import Session

    from lmscope.db.models import Job, utcnow

    engine = create_engine(f"sqlite:///{up_env['LMSCOPE_DATA_DIR']}/lmscope.db")
    now = utcnow()
    with Session(engine) as session, session.begin():
        running = Job(user_id=session.get(Job, jobs["a"]).user_id, kind="probe", params={"model": "tiny-gpt2"},
                      status="running", tags=[], created_at=now, started_at=now, heartbeat_at=now + timedelta(days=1),
                      name="dash running")
        session.add(running)
        session.flush()
        running_id = running.id
    try:
        open_job(page, url, running_id)
        page.wait("document.getElementById('cancel')")
        assert page.js("document.getElementById('delete-job')") is None
        refused = requests.delete(f"{url}/v1/jobs/{running_id}", timeout=30)
        assert refused.status_code == 409 and refused.json()["type"].endswith("/job-active"), refused.text
    finally:
        with Session(engine) as session, session.begin():  # gone again: no worker runs it
            session.execute(delete(Job).where(Job.id == running_id))
        engine.dispose()

    point = jobs["children"][0]
    open_job(page, url, point)
    page.wait("document.getElementById('parent-link')")
    assert page.js("document.getElementById('delete-job')") is None
    refused = requests.delete(f"{url}/v1/jobs/{point}", timeout=30)
    assert refused.status_code == 409 and refused.json()["type"].endswith("/job-in-sweep"), refused.text
    open_job(page, url, jobs["sweep"])  # its sweep has one (the module's: not pressed)
    page.wait("document.getElementById('delete-job')")


def test_a_refused_delete_says_why_beside_the_button_and_keeps_the_page(page, url, jobs):
    """A train job whose checkpoints are registered models: the API's refusal beside the button, the page kept;
    with the models removed, the same button deletes it."""
    run = "dash-delete-run"
    train = submit(url, "train", {**TINY_TRAIN, "run_name": run})
    assert Client(url).wait(train, timeout=180)["status"] == "succeeded"
    open_job(page, url, train)
    page.wait("document.getElementById('delete-job')")
    answer_confirm(page, True)
    page.click("#delete-job")
    page.wait("document.getElementById('delete-error')?.textContent")
    refused = requests.delete(f"{url}/v1/jobs/{train}", timeout=30)
    problem = refused.json()
    assert refused.status_code == 409 and problem["type"].endswith("/job-has-models"), refused.text
    assert page.text("#delete-error") == f"Could not delete: {problem['title']}: {problem['detail']}"
    assert f"lmscope models delete --run {run}" in page.text("#delete-error")
    wait_refreshes(page, 2)
    assert page.js("location.hash") == f"#job={train}" and page.text("#delete-error").startswith("Could not delete")
    assert page.js("$('delete-job').disabled") is False
    assert requests.get(f"{url}/v1/jobs/{train}", timeout=30).status_code == 200

    for name in problem["models"]:
        assert requests.delete(f"{url}/v1/models/{name}", timeout=30).status_code == 204, name
    page.click("#delete-job")
    page.wait("location.hash === ''")
    page.wait(f"document.getElementById('list-note').textContent.startsWith('Deleted job {train} (freed ')")
    assert requests.get(f"{url}/v1/jobs/{train}", timeout=30).status_code == 410


def test_run_again_fills_the_form_with_the_jobs_kind_and_params(page, url, jobs):
    """A job's "Run again…" puts its kind and every parameter as its row keeps them into the submit form (not its
    name or tags); submitting makes a new job with those params. A sweep's grid point has no such button."""
    a = api(url, f"/v1/jobs/{jobs['a']}")
    assert a["name"] and a["tags"]  # what must not be carried over
    open_job(page, url, a["id"])
    page.js("""(() => { document.getElementById('submit-box').open = false;
                document.getElementById('name').value = 'typed earlier';
                document.getElementById('submit-error').textContent = 'an old error';
                document.getElementById('params').classList.add('wanted'); return true; })()""")
    page.click("#run-again")
    assert page.js("document.getElementById('submit-box').open")
    assert page.js("document.activeElement.id") == "params"
    assert page.js("document.getElementById('kind').value") == "probe"
    assert form_params(page) == a["params"] and len(a["params"]) > 1  # the defaults written out too
    assert page.js("[document.getElementById('name').value, document.getElementById('tags').value]") == ["", ""]
    assert page.text("#submit-error") == "" and page.js("document.querySelectorAll('#submit-form .wanted').length") == 0
    assert page.js("document.getElementById('submit-box').getBoundingClientRect().top < innerHeight")  # in view
    page.click("#submit")
    page.wait(f"/^#job=\\d+$/.test(location.hash) && location.hash !== '#job={a['id']}'")
    again = api(url, f"/v1/jobs/{int(page.js('location.hash').split('=')[1])}")
    assert (again["kind"], again["params"], again["name"], again["tags"]) == ("probe", a["params"], None, [])
    wait_job(page, again["id"])
    assert Client(url).wait(again["id"], timeout=120)["status"] == "succeeded"

    open_job(page, url, jobs["sweep"])  # a sweep runs again as a whole
    page.wait("document.getElementById('run-again')")
    page.click("#run-again")
    assert page.js("document.getElementById('kind').value") == "sweep"
    assert form_params(page) == api(url, f"/v1/jobs/{jobs['sweep']}")["params"]
    open_job(page, url, jobs["children"][0])
    assert page.js("document.getElementById('run-again')") is None


def test_a_seed_past_2_to_the_53_is_shown_and_run_again_exactly(page, url, jobs):
    """Seeds go up to 2^63 − 1; JavaScript numbers hold integers exactly only to 2^53, and "Run again…" once
    submitted 9007199254740992 for 9007199254740993 (another sample of trajectories)."""
    seed = 2**53 + 1
    first = submit(url, "norms", {"model": "tiny-gpt2", "dataset": "wikitext-2", "min_words": 100000, "seed": seed})
    assert Client(url).wait(first, timeout=120)["status"] == "failed"  # (fast: no document is that long)
    open_job(page, url, first)
    cells = page.js("Object.fromEntries([...document.querySelectorAll('#params-table tr')]"
                    ".map(r => [r.cells[0]?.textContent, r.cells[1]?.textContent]))")
    assert cells["seed"] == str(seed)
    page.click("#run-again")
    assert f'"seed": {seed}' in page.js("document.getElementById('params').value")
    page.click("#submit")
    page.wait(f"/^#job=\\d+$/.test(location.hash) && location.hash !== '#job={first}'")
    again = int(page.js("location.hash").split("=")[1])
    assert requests.get(f"{url}/v1/jobs/{again}", timeout=30).json()["params"]["seed"] == seed  # (Python: exact)
    wait_job(page, again)
    Client(url).wait(again, timeout=120)

    # A browser without JSON.rawJSON (older Firefox and Safari) cannot hold the seed: "Run again…" says so, and
    # params typed into the form are sent as written, so typed digits arrive whole.
    added = page.page("Page.addScriptToEvaluateOnNewDocument", source="delete JSON.rawJSON; delete JSON.isRawJSON;")
    try:
        page.goto(f"{url}/docs")  # a new document (a change of hash alone would keep this one)
        page.goto(f"{url}/#job={first}")
        wait_job(page, first)
        assert page.js("typeof JSON.rawJSON") == "undefined"
        page.click("#run-again")
        assert "rounds integers past 2^53" in page.text("#submit-error")
        assert f"lmscope submit norms --params job:{first}" in page.text("#submit-error")
        page.js(f"""(() => {{ const p = document.getElementById('params');
                   p.value = p.value.replace(/"seed": \\d+/, '"seed": {seed}'); return true; }})()""")
        page.click("#submit")
        page.wait(f"/^#job=\\d+$/.test(location.hash) && !['#job={first}', '#job={again}'].includes(location.hash)")
        typed = int(page.js("location.hash").split("=")[1])
        assert requests.get(f"{url}/v1/jobs/{typed}", timeout=30).json()["params"]["seed"] == seed
        wait_job(page, typed)
        Client(url).wait(typed, timeout=120)
    finally:
        page.page("Page.removeScriptToEvaluateOnNewDocument", identifier=added["identifier"])
