"""The `lmscope` command against the API on a real port: what a first-time user sees."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from lmscope.cli import main
from lmscope.db.models import Series, utcnow


@pytest.fixture
def db_url(sqlite_url):
    """SQLite only: the SQL behind these answers is tested on both databases in the other files."""
    return sqlite_url


@pytest.fixture
def cli(api, live):
    api.user("ann")
    env = {"LMSCOPE_URL": live.url, "LMSCOPE_TOKEN": api.tokens["ann"]}

    def run(*args, input=None):
        return CliRunner(env=env).invoke(main, list(args), input=input)

    return run


def test_whoami_shows_the_limits_and_where_they_come_from(api, cli):
    from sqlalchemy import update

    from lmscope.db.models import User

    with api.sessions.begin() as session:
        session.execute(update(User).where(User.name == "ann").values(max_sweep_points=3))
    api.submit(api.user("ann"))
    assert api.client.post("/v1/datasets?name=mine&format=text", headers=api.user("ann"),
                           data=b"one two three").status_code == 201
    r = cli("whoami")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == ("ann: 1 active job(s), 13 bytes of uploads, 0 bytes of job files; max_active_jobs=5 (server default), "
                                "max_sweep_points=3, max_uploaded_bytes=1.0 GiB (server default)")


def test_a_refused_submit_names_each_bad_field_once(api, cli):
    r = cli("submit", "norms", "-p", "model=m", "-p", "dataset=d", "-p", "max_sample=5")
    assert r.exit_code == 1
    assert r.output.count("max_sample") == 2  # the field and "did you mean 'max_samples'?", once each
    assert "did you mean 'max_samples'?" in r.output


def test_kinds_kind_lists_every_parameter_with_its_default(api, cli):
    from lmscope.params.norms import NormsParams

    r = cli("kinds", "norms")
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("PARAMETER"))
    start, end = out[header].index("DEFAULT"), out[header].index("LIMITS")
    lines = {line.split()[0]: line for line in out[header + 1:] if line.strip() and not line.startswith("Set ")}
    for name, field in NormsParams.model_fields.items():
        assert name in lines, name
        expected = "required" if field.is_required() else json.dumps(field.get_default(call_default_factory=True))
        assert lines[name][start:end].strip() == expected, lines[name]
    assert "≥ 1" in lines["max_samples"] and "documents" in lines["max_samples"]
    # the defaults issue #5 names, written out: the table above only mirrors the model's own defaults
    issue_defaults = {"model": "required", "max_samples": "5000", "min_words": "10", "max_tokens": "256",
                      "position": '"last"', "min_position": "5", "include_last_layer": "false", "loss_filter": "1.0",
                      "pca_samples": "50", "gram_samples": "200"}
    assert {k: lines[k][start:end].strip() for k in issue_defaults} == issue_defaults
    sweep = cli("kinds", "sweep").output
    assert "grid.latent_dim" in sweep and "train.epochs" in sweep and "one of poly_sumformer" in sweep
    rows = {line.split()[0]: line for line in sweep.splitlines()[2:] if line.strip()}
    # which study reads each field, written out from issue #7 (not from the code's own field lists), with
    # the attention study's additions (Linformer's projections, BOS-first windows)
    sumformer = {"target", "architectures", "grid", "train"}
    attention = {"model", "dataset", "layers", "methods", "features", "seq_len", "num_segments", "seeds",
                 "batch_size", "linformer_projection", "bos_per_window"}
    assert sumformer | attention | {"study"} <= {name.split(".")[0] for name in rows}
    for name, line in rows.items():  # every field says which study reads it; `study` chooses
        top = name.split(".")[0]
        expected = "sumformer" if top in sumformer else "attention" if top in attention else None
        assert (f"[study={expected}]" in line) if expected else ("[study=" not in line), line
    assert "fig2_poly" in rows["target"] and "attention:" in rows["study"]
    missing = cli("kinds", "nrms")
    assert missing.exit_code == 1 and "no kind 'nrms'; did you mean 'norms'?" in missing.output
    # a kind whose parameter names are shorter than the header's: the columns still start under it
    out = cli("kinds", "probe").output.splitlines()
    header = next(line for line in out if line.startswith("PARAMETER"))
    model = next(line for line in out if line.startswith("model "))
    assert model.index("string") == header.index("TYPE"), (header, model)


def test_kinds_writes_a_long_default_in_full_and_a_child_kind_points_to_its_parent(api, cli):
    """pruning's default grid of fractions was cut to `[0.0, 0.1, … 0...`; sumformer_fit said "(not submitted on
    its own)" and then "Set them with `lmscope submit sumformer_fit`", which is refused."""
    from lmscope.params.pruning import PruningParams

    out = cli("kinds", "pruning").output
    header, *lines = out.split("\n\n")[1].splitlines()
    start, end = header.index("DEFAULT"), header.index("LIMITS")
    table = {line.split()[0]: line[start:end].strip() for line in lines}
    assert table["fractions"] == table["orders"] == "(below)" and table["tolerance"] == "0.01"
    full = dict(line.strip().split(" = ", 1) for line in out.split("Defaults in full:\n")[1].splitlines()
                if " = " in line)
    for name in ("fractions", "orders"):
        assert json.loads(full[name]) == PruningParams.model_fields[name].get_default(call_default_factory=True)
    assert "Set them with `lmscope submit pruning -p NAME=VALUE`" in out
    child = cli("kinds", "sumformer_fit").output
    assert "lmscope submit sumformer_fit" not in child
    assert "sumformer_fit's jobs are made by sweep, which sets these from its own parameters: see `lmscope kinds " \
        "sweep`." in child


def test_jobs_lists_a_sweep_once_and_its_children_on_request(api, cli):
    from .conftest import small_sweep

    probe = api.submit(api.user("ann")).get_json()["id"]
    sweep = api.submit(api.user("ann"), kind="sweep", params=small_sweep(3)).get_json()["id"]
    kids = [j.id for j in api.jobs(parent_id=sweep)]

    def ids(*args):
        r = cli("jobs", *args)
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        return lines[0].split(), [int(line.split()[0]) for line in lines[1:]]

    header, listed = ids()
    assert listed == [sweep, probe] and "PARENT" not in header
    header, listed = ids("--children")
    assert sorted(listed) == sorted([probe, sweep, *kids]) and "PARENT" in header
    assert sorted(ids("--kind", "sumformer_fit")[1]) == sorted(kids)  # a child kind lists children
    assert sorted(ids("--kind", "probe, sumformer_fit")[1]) == sorted([probe, *kids])  # so does one among kinds
    assert ids("--kind", "probe,sweep")[1] == [sweep, probe]
    assert sorted(ids("--parent", str(sweep))[1]) == sorted(kids)
    # a sweep is run again as a whole; a grid point on its own is not submittable, so `show` offers no command
    assert f"lmscope submit sweep --params job:{sweep}" in cli("show", str(sweep)).stdout
    assert "run again" not in cli("show", str(kids[0])).stdout
    r = cli("submit", "sumformer_fit", "--params", f"job:{kids[0]}")
    assert r.exit_code == 2 and f"is a grid point of sweep {sweep}" in r.output
    assert f"lmscope submit sweep --params job:{sweep}" in r.output


def test_a_string_field_keeps_a_numeric_value_as_text(api, cli):
    """`-p model=123` used to send the number 123 ("Input should be a valid string")."""
    api.add_model("123")
    r = cli("submit", "probe", "-p", "model=123", "-p", "prompt=true")
    assert r.exit_code == 0, r.output
    job = api.jobs()[-1]
    assert job.params["model"] == "123" and job.params["prompt"] == "true"


def test_jobs_says_when_the_list_was_cut_off(api, cli):
    ids = [api.submit(api.user("ann")).get_json()["id"] for _ in range(3)]
    r = cli("jobs", "--limit", "2", "--kind", "probe")
    assert r.exit_code == 0, r.output
    rows = r.stdout.splitlines()[1:]
    assert [int(x.split()[0]) for x in rows] == ids[::-1][:2]
    assert "… more jobs: lmscope jobs --kind probe --limit 4 (or --all)" in r.stderr
    exact = cli("jobs", "--limit", "3")
    assert len(exact.stdout.splitlines()) == 4 and "more" not in exact.stderr
    every = cli("jobs", "--all")
    assert len(every.stdout.splitlines()) == 4 and "more" not in every.stderr


def test_jobs_with_every_tag_given(api, cli):
    """`--tag` is repeatable (jobs with every tag); it kept only the last one, silently. A comma list,
    as the TAGS column writes a job's tags, is one tag: the CLI says so when nothing matched."""
    h = api.user("ann")
    both = api.submit(h, tags=["smoke", "exp1"]).get_json()["id"]
    smoke = api.submit(h, tags=["smoke"]).get_json()["id"]

    def listed(*tags):
        r = cli("jobs", *[a for t in tags for a in ("--tag", t)])
        assert r.exit_code == 0, r.output
        return [int(line.split()[0]) for line in r.stdout.splitlines()[1:]], r.stderr

    assert listed("smoke") == ([smoke, both], "")
    assert listed("smoke", "exp1") == ([both], "")
    assert listed("nonexist", "smoke")[0] == []
    ids, hint = listed("smoke,exp1")
    assert ids == [] and "--tag smoke --tag exp1" in hint


def test_an_admin_lists_one_users_jobs_and_a_user_cannot(api, cli, live):
    ann = api.submit(api.user("ann")).get_json()["id"]
    bob = api.submit(api.user("bob")).get_json()["id"]
    api.user("root", admin=True)
    admin = CliRunner(env={"LMSCOPE_URL": live.url, "LMSCOPE_TOKEN": api.tokens["root"]})

    def listed(r):
        assert r.exit_code == 0, r.output
        return r.stdout.splitlines()[0].split(), [int(line.split()[0]) for line in r.stdout.splitlines()[1:]]

    header, ids = listed(admin.invoke(main, ["jobs"]))
    assert ids == [bob, ann] and "USER" in header  # everyone's, with whose they are
    assert listed(admin.invoke(main, ["jobs", "--user", "bob"]))[1] == [bob]
    refused = cli("jobs", "--user", "bob")
    assert refused.exit_code == 1 and "admin" in refused.output


def test_show_says_whether_a_queued_job_was_handed_to_the_queue(api, cli):
    job_id = api.submit(api.user("ann")).get_json()["id"]
    api.set_job(job_id, published_at=None)  # the broker was down at submit
    shown = cli("show", str(job_id)).stdout
    assert "published_at" not in shown and "not handed to the broker yet" in shown
    api.set_job(job_id, published_at=utcnow())
    shown = cli("show", str(job_id)).stdout
    assert "published_at" in shown and "not handed to the broker" not in shown
    # and what it waits behind
    later = api.submit(api.user("ann")).get_json()["id"]
    assert "queue        behind 1 queued job, 0 running" in cli("show", str(later)).stdout.splitlines()


def test_show_prints_text_as_written(api, cli):
    """Summary notes are for reading: `≤` and `α` appear as themselves, not as JSON escapes."""
    job_id = api.submit(api.user("ann")).get_json()["id"]
    api.set_job(job_id, summary={"note": "kept ≤ loss_filter", "heads": ["α"]})
    out = cli("show", str(job_id)).stdout
    assert "kept ≤ loss_filter" in out and '"α"' in out and "\\u" not in out


def test_jobs_filter_errors_name_the_valid_values(cli):
    typo = cli("jobs", "--kind", "nrms")
    assert typo.exit_code == 1 and "'nrms'" in typo.stderr and "norms" in typo.stderr
    parent = cli("jobs", "--parent", "abc")
    assert parent.exit_code == 1 and "`none`" in parent.stderr
    missing = cli("show", "4242")
    assert missing.exit_code == 1 and "`lmscope jobs`" in missing.stderr


def test_results_name_the_series_that_exist(api, cli):
    job_id = api.submit(api.user("ann")).get_json()["id"]
    with api.sessions.begin() as session:
        session.add(Series(job_id=job_id, name="norm.mean", labels={}, x=[0], y=[1.0]))
        session.add(Series(job_id=job_id, name="loss.val", labels={}, x=[0], y=[2.0]))
    r = cli("results", str(job_id), "--series", "nonexistent")
    assert r.exit_code == 1
    assert "no series matched 'nonexistent'" in r.stderr and f"job {job_id} has: loss.val, norm.mean" in r.stderr
    partly = cli("results", str(job_id), "--series", "norm.mean", "--series", "nope", "--format", "csv")
    assert partly.exit_code == 0 and partly.stdout.splitlines()[1].startswith("norm.mean,")
    assert "'nope'" in partly.stderr


def test_fetch_says_when_a_job_has_no_artifacts(api, cli, tmp_path):
    job_id = api.submit(api.user("ann")).get_json()["id"]
    r = cli("fetch", str(job_id), str(tmp_path / "out"))
    assert r.exit_code == 0 and f"job {job_id} (queued) has no artifacts yet" in r.stderr
    api.set_job(job_id, status="cancelled", finished_at=utcnow())
    assert f"job {job_id} (cancelled) has no artifacts\n" in cli("fetch", str(job_id), str(tmp_path / "out")).stderr


def test_fetch_into_a_place_it_cannot_write_is_one_line(api, cli, tmp_path):
    """An OSError from writing the files used to end the command with a traceback."""
    from .conftest import add_results

    job_id = api.submit(api.user("ann")).get_json()["id"]
    add_results(api, job_id, {"plots/norms.png": b"\x89PNG", "a.npz": b"PK"})
    a_file = tmp_path / "x.txt"
    a_file.write_text("")
    for target in (a_file / "sub", "/proc/lmscope-nope"):
        r = cli("fetch", str(job_id), str(target))
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert f"Error: cannot save job {job_id}'s artifacts in {target}:" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert f"{a_file} is a file, not a folder" in cli("fetch", str(job_id), str(a_file / "sub")).stderr
    assert cli("fetch", str(job_id), str(tmp_path / "out")).exit_code == 0
    assert not list((tmp_path / "out").rglob("*.part"))


def test_show_of_a_finished_job_does_not_present_its_last_stage_as_live(api, cli):
    job_id = api.submit(api.user("ann")).get_json()["id"]
    stage = "step 450 · loss 3.1 · ETA 1m17s"
    api.set_job(job_id, status="running", progress_done=450, progress_total=1000, progress_stage=stage)
    running = cli("show", str(job_id)).stdout
    assert "progress" in running and "ETA 1m17s" in running
    api.set_job(job_id, status="cancelled", finished_at=utcnow())
    cancelled = cli("show", str(job_id)).stdout
    assert "last progress" in cancelled and "450/1000" in cancelled and "ETA" not in cancelled


def test_kinds_lists_child_kinds_as_not_submittable(cli):
    lines = cli("kinds").stdout.splitlines()
    by_name = {line.split()[0]: line for line in lines}
    assert "(child of sweep; not submittable)" in by_name["sumformer_fit"]
    assert "(child of sweep; not submittable)" in by_name["attention_approx"]
    assert "not submittable" not in by_name["probe"] and "norms" in by_name


def test_a_filter_error_keeps_the_apis_advice(cli):
    r = cli("jobs", "--status", "bogus")
    assert r.exit_code == 1
    assert "unknown status 'bogus'; use one of: queued, running" in r.stderr  # not only "query.status: unknown status"


def test_an_unknown_kind_is_said_with_its_suggestion_and_the_kinds_once(cli):
    r = cli("submit", "nrms")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("Error: Unknown job kind: kind 'nrms' does not exist; did you mean 'norms'?"), lines
    assert len(lines) == 2 and lines[1].startswith("  kind: unknown kind; the kinds are ") and r.stderr.count("probe") == 1


def test_an_unknown_model_is_said_once_with_the_field_it_is_in(cli):
    """The detail of an unknown reference only joins its field messages: it was printed twice."""
    r = cli("submit", "probe", "-p", "model=nope")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert lines[0] == "Error: Unknown model, dataset or job", lines
    assert len(lines) == 2 and lines[1].startswith("  params.model: ") and "'nope'" in lines[1], lines


def test_resubmitting_with_an_idempotency_key_says_nothing_new_was_queued(api, cli):
    first = cli("submit", "probe", "-p", "model=m", "--idempotency-key", "k1")
    again = cli("submit", "probe", "-p", "model=m", "--idempotency-key", "k1")
    assert first.exit_code == again.exit_code == 0, again.output
    job_id = int(first.stdout)
    assert f"submitted job {job_id} (probe)" in first.stderr
    assert f"already submitted with this idempotency key: job {job_id} (probe, queued)" in again.stderr
    assert int(again.stdout) == job_id and len(api.jobs()) == 1
    spaced = cli("submit", "probe", "-p", "model=m", "--idempotency-key", " k1")  # was an InvalidHeader traceback
    assert spaced.exit_code == 0 and int(spaced.stdout) == job_id, spaced.output


def test_a_job_submitted_while_the_broker_is_down_says_so(api, cli):
    """The trial's operator saw only "submitted job 8 (probe)" and a `--wait` line that never moved."""
    api.publisher.fail = True
    r = cli("submit", "probe", "-p", "model=m")
    assert r.exit_code == 0, r.output
    job_id = int(r.stdout)
    assert r.stderr.strip() == (f"submitted job {job_id} (probe); the broker has not taken it yet (it did not "
                                "answer): the reaper hands it over when it does (GET /readyz says whether it answers)")
    api.publisher.fail = False
    assert "broker" not in cli("submit", "probe", "-p", "model=m").stderr


def test_a_sweep_submitted_while_the_broker_is_down_says_its_children_wait(api, cli, tmp_path):
    """A sweep is running at once (it holds no worker): only its children wait for the broker, and the
    submit line said nothing about them."""
    from .conftest import small_sweep
    params = tmp_path / "sweep.json"
    params.write_text(json.dumps(small_sweep(3)))
    api.publisher.fail = True
    r = cli("submit", "sweep", "--params", str(params))
    assert r.exit_code == 0, r.output
    sweep = int(r.stdout)
    assert r.stderr.strip() == (f"submitted job {sweep} (sweep) with 3 children; 3 children not handed to the broker "
                                "yet (the broker did not answer): the reaper sends them when the broker answers "
                                "(GET /readyz says whether it does)")
    headers = api.user("ann")
    body = api.client.get(f"/v1/jobs/{sweep}", headers=headers).get_json()
    assert body["children_unsent"] == 3 and body["children"]["queued"] == 3
    listed = api.client.get("/v1/jobs?parent=none", headers=headers).get_json()["items"]
    assert [j["id"] for j in listed] == [sweep] and "children_unsent" not in listed[0]  # lists leave it out
    shown = cli("show", str(sweep)).stdout
    assert "3 children not handed to the broker yet: the reaper sends them when the broker answers" in shown

    # The reaper sends one (here: the row marked as published); the count follows the database.
    kid = min(j.id for j in api.jobs(parent_id=sweep))
    api.set_job(kid, published_at=utcnow())
    assert api.client.get(f"/v1/jobs/{sweep}", headers=headers).get_json()["children_unsent"] == 2
    api.publisher.fail = False
    r = cli("submit", "sweep", "--params", str(params))
    assert r.exit_code == 0 and "broker" not in r.stderr, r.output
    assert "children_unsent" not in api.client.get(f"/v1/jobs/{int(r.stdout)}", headers=headers).get_json()
    # `lmscope up` has no broker: its worker reads the queue from SQL, so no job waits for one
    api.app.extensions["lmscope"].worker_stopped = lambda: None
    assert "children_unsent" not in api.client.get(f"/v1/jobs/{sweep}", headers=headers).get_json()


def test_results_of_a_job_without_series_say_why(api, cli):
    job_id = api.submit(api.user("ann")).get_json()["id"]
    api.set_job(job_id, status="failed", finished_at=utcnow(), error_type="out-of-memory", error_message="CUDA OOM")
    r = cli("results", str(job_id))
    assert r.exit_code == 0 and json.loads(r.stdout)["series"] == []
    assert f"job {job_id} (failed) has no series: it failed (out-of-memory); `lmscope show {job_id}`" in r.stderr


def test_jobs_parent_of_a_job_that_is_not_a_sweep(api, cli):
    job_id = api.submit(api.user("ann")).get_json()["id"]
    r = cli("jobs", "--parent", str(job_id))
    assert r.exit_code == 0 and f"job {job_id} is a probe job, not a sweep: it has no children" in r.stderr
    assert cli("jobs", "--parent", "4242").exit_code == 1  # no such job: the API's 404


def test_more_jobs_hint_keeps_every_option(api, cli):
    for _ in range(3):
        api.submit(api.user("ann"))
    r = cli("jobs", "--limit", "2", "--json", "--children")
    assert "… more jobs: lmscope jobs --children --json --limit 4 (or --all)" in r.stderr


def test_wait_prints_the_summary_as_json_values(api, cli):
    job_id = api.submit(api.user("ann")).get_json()["id"]
    api.set_job(job_id, status="succeeded", finished_at=utcnow(),
                summary={"loss_filter": None, "sequence_pct": 46.400000000000006, "position": "last", "ok": True})
    out = cli("wait", str(job_id)).stdout
    assert "loss_filter: null" in out and "sequence_pct: 46.4\n" in out and "position: last" in out
    assert "ok: true" in out


def test_wait_names_a_failed_jobs_plots_without_urls_a_browser_cannot_open(api, cli, live):
    """With a token the artifact URLs answer 401 in a browser: name the plots and the dashboard page instead."""
    from .conftest import add_results

    job_id = api.submit(api.user("ann")).get_json()["id"]
    api.set_job(job_id, status="failed", finished_at=utcnow(), error_type="time-limit", error_message="too long")
    add_results(api, job_id, {"loss.png": b"\x89PNG"})
    out = cli("wait", str(job_id)).stdout
    assert f"1 artifact (1 plot, 4 bytes): lmscope fetch {job_id} DIR" in out  # a failed job's files are listed too
    assert f"plots: loss.png (also on {live.url}/#job={job_id}" in out and "/artifacts/" not in out
    assert f"1 artifact (1 plot, 4 bytes): lmscope fetch {job_id} DIR" in cli("show", str(job_id)).stdout


def test_the_cli_finds_a_local_server_on_lmscope_port(monkeypatch):
    from lmscope.client import Client

    monkeypatch.delenv("LMSCOPE_URL", raising=False)
    monkeypatch.setenv("LMSCOPE_PORT", "8799")
    assert Client().url == "http://127.0.0.1:8799"
    monkeypatch.setenv("LMSCOPE_URL", "http://gpu-box:9000/")
    assert Client().url == "http://gpu-box:9000"  # an explicit URL wins


def test_an_unreadable_lmscope_port_is_named_by_client_commands(monkeypatch):
    """LMSCOPE_PORT=80a made `lmscope jobs` blame LMSCOPE_URL (an address it had built from the port)."""
    monkeypatch.delenv("LMSCOPE_URL", raising=False)
    for bad in ("80a", "0", "70000", "٣"):
        monkeypatch.setenv("LMSCOPE_PORT", bad)
        r = CliRunner().invoke(main, ["jobs"])
        assert r.exit_code == 1 and f"LMSCOPE_PORT={bad!r} is not a port" in r.output, r.output
        assert "LMSCOPE_URL" not in r.output.split("is not a port")[0]
    monkeypatch.setenv("LMSCOPE_URL", "http://127.0.0.1:9")  # with an address the port is not read
    assert "LMSCOPE_PORT" not in CliRunner().invoke(main, ["jobs"]).output


def _two_norms_like_jobs(api):
    """Two finished jobs on different models, with summaries and curves (layer 3 only in the second)."""
    api.add_model("m2")
    h = api.user("ann")
    a = api.submit(h, params={"model": "m"}, name="small").get_json()["id"]
    b = api.submit(h, params={"model": "m2"}).get_json()["id"]
    api.set_job(a, status="succeeded", finished_at=utcnow(), summary={"sequence_pct": 40.0, "samples": 10, "x": [1]})
    api.set_job(b, status="succeeded", finished_at=utcnow(), summary={"sequence_pct": 55.5, "samples": 10})
    with api.sessions.begin() as session:
        session.add(Series(job_id=a, name="norm.mean", labels={}, x=[0, 1, 2], y=[1.0, 2.0, 3.0]))
        session.add(Series(job_id=b, name="norm.mean", labels={}, x=[0, 1, 2, 3], y=[1.5, 2.5, 3.5, 4.5]))
        session.add(Series(job_id=a, name="entropy.mean", labels={"layer": 0}, x=[0], y=[0.7]))
        session.add(Series(job_id=b, name="entropy.mean", labels={"layer": 0}, x=[0], y=[0.9]))
        session.add(Series(job_id=b, name="entropy.mean", labels={"layer": 1}, x=[0], y=[0.8]))
    return a, b


def test_compare_puts_params_summaries_and_curves_side_by_side(api, cli, tmp_path, monkeypatch):
    a, b = _two_norms_like_jobs(api)
    table = cli("compare", str(a), str(b))
    assert table.exit_code == 0, table.output
    rows = {line.split()[0]: line.split()[1:] for line in table.stdout.splitlines()[1:]}
    assert rows["params.model"] == ["m", "m2"]  # only the parameters that differ
    assert "params.prompt" not in rows and "params.dtype" not in rows
    assert rows["sequence_pct"] == ["40", "55.5"] and rows["samples"] == ["10", "10"]
    assert rows["x"] == ["[1]", "-"]  # a short list is compared too; the second job has none
    assert "curves all of them have: entropy.mean, norm.mean" in table.stderr

    curves = cli("compare", str(a), str(b), "--series", "norm.mean", "--format", "csv").stdout.splitlines()
    assert curves[0] == f"series,x_meaning,x,job {a},job {b}"
    h = '"hidden state h_l (l = 0: embedding output, l: output of block l)"'
    assert curves[1:] == [f"norm.mean,{h},0,1.0,1.5", f"norm.mean,{h},1,2.0,2.5", f"norm.mean,{h},2,3.0,3.5",
                          f"norm.mean,{h},3,,4.5"]  # x aligned by value; the first job has no layer 3

    doc = json.loads(cli("compare", str(a), str(b), "--series", "entropy.*", "--format", "json").stdout)
    by_layer = {s["labels"]["layer"]: s["jobs"] for s in doc["series"]}
    assert by_layer[0] == {str(a): {"x": [0], "y": [0.7]}, str(b): {"x": [0], "y": [0.9]}}
    assert by_layer[1] == {str(b): {"x": [0], "y": [0.8]}}  # matched by labels, not by position

    import lmscope.compare as compare_module

    figures, draw = [], compare_module.comparison_figure
    monkeypatch.setattr(compare_module, "comparison_figure", lambda c, **kw: figures.append(draw(c, **kw)) or figures[-1])
    plot = cli("compare", str(a), str(b), "--series", "norm.mean", "--series", "entropy.mean",
               "--plot", str(tmp_path / "cmp.png"), "--logx", "--logy")
    assert plot.exit_code == 0, plot.output
    norm, entropy = figures[0].axes[:2]
    assert (norm.get_xscale(), norm.get_yscale()) == ("log", "log")  # layers 1-3 on a log x; layer 0 said
    assert "2 point(s) at x ≤ 0 not drawn" in norm.get_xlabel()  # each job's layer 0
    assert (entropy.get_xscale(), entropy.get_yscale()) == ("linear", "log")  # only x = 0: no log x to draw
    from PIL import Image

    with Image.open(tmp_path / "cmp.png") as im:
        assert im.size[0] > im.size[1] > 200  # two panels side by side


def test_compare_shows_values_that_differ_past_six_digits_in_full(api, cli):
    """Two runs whose float sums rounded apart (another thread count): six digits would print the row the same
    in both columns while listing it among the differences."""
    h = api.user("ann")
    a, b = (api.submit(h).get_json()["id"] for _ in range(2))
    variance = [0.9123456789012345, 0.0512345678901234, 0.0100000001]
    api.set_job(a, status="succeeded", finished_at=utcnow(), summary={"mean": 2.4453125, "ratios": [0.5, 0.25000001],
                                                                      "pct": 40.0, "variance": variance})
    api.set_job(b, status="succeeded", finished_at=utcnow(), summary={"mean": 2.4453126, "ratios": [0.5, 0.25],
                                                                      "pct": 55.5, "variance": [*variance[:2], 0.0100000002]})
    table = cli("compare", str(a), str(b))
    rows = {line.split()[0]: line.split()[1:] for line in table.stdout.splitlines()[1:]}
    assert rows["mean"] == ["2.4453125", "2.4453126"]
    assert rows["ratios"] == ["[0.5,", "0.25000001]", "[0.5,", "0.25]"]  # (split on spaces here)
    assert rows["pct"] == ["40", "55.5"]  # apart within six digits: six digits
    # a long list that differs only past the 40 characters a cell shows: cut where the two stay apart
    long = [line for line in table.stdout.splitlines() if line.startswith("variance")][0]
    assert "0.0100000001" in long and "0.0100000002" in long, long


def test_compare_plot_into_a_place_it_cannot_write_is_one_line(api, cli, tmp_path):
    a, b = _two_norms_like_jobs(api)
    (tmp_path / "x.txt").write_text("")
    target = tmp_path / "x.txt" / "cmp.png"
    r = cli("compare", str(a), str(b), "--series", "norm.mean", "--plot", str(target))
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert r.stderr.startswith(f"Error: cannot write the plot to {target}: ") and len(r.stderr.splitlines()) == 1
    assert f"{tmp_path / 'x.txt'} is a file, not a folder" in r.stderr  # not "File exists"
    # a missing folder is made, as `lmscope fetch` makes its own
    made = tmp_path / "new" / "cmp.png"
    assert cli("compare", str(a), str(b), "--series", "norm.mean", "--plot", str(made)).exit_code == 0 and made.exists()


def test_compare_refuses_what_it_cannot_do(api, cli):
    a, b = _two_norms_like_jobs(api)
    one = cli("compare", str(a))
    assert one.exit_code == 2 and "at least two different job ids" in one.stderr
    assert "--series" in cli("compare", str(a), str(b), "--plot", "x.png").stderr
    assert cli("compare", str(a), "4242").exit_code == 1  # the API's 404 names the job
    nothing = cli("compare", str(a), str(b), "--series", "nope")
    assert "no job has series 'nope'" in nothing.stderr
    unplotted = cli("compare", str(a), str(b), "--series", "nope", "--plot", "x.png")
    assert unplotted.exit_code == 1
    assert "nothing to plot: these jobs have no series 'nope' (series all of them have: entropy.mean, norm.mean)" \
        in unplotted.stderr


def test_models_delete_run_removes_every_checkpoint_of_a_run(api, cli, live):
    from lmscope.client import Client
    from lmscope.db.models import Model

    run = api.submit(api.user("ann"), kind="train", params={"dataset": "d", "run_name": "blip"}).get_json()["id"]
    api.set_job(run, status="cancelled")
    with api.sessions.begin() as session:
        for name, step in (("blip@step0", 0), ("blip@step10", 10), ("blip@step5", 5), ("blip2@step0", 0)):
            session.add(Model(name=name, source="checkpoint", num_layers=2, job_id=run, step=step))
    reader = api.submit(api.user("ann"), kind="probe", params={"model": "blip@step5"}).get_json()["id"]
    r = cli("models", "--run", "blip", "delete")  # the group's --run, as `models --run blip` lists them
    assert r.exit_code == 1
    assert r.stdout.splitlines() == ["removed model blip@step0", "removed model blip@step10"]  # one refusal stops nothing
    assert f"kept model blip@step5: Jobs use this model: job(s) {reader} read" in r.stderr
    assert "run 'blip' keeps 1 checkpoint (blip@step5), so its name stays taken; `lmscope models delete --run blip` " \
        "again once they are free" in r.stderr
    # another user is told whose they are, not to try again
    api.user("bob")
    theirs = CliRunner(env={"LMSCOPE_URL": live.url, "LMSCOPE_TOKEN": api.tokens["bob"]}).invoke(
        main, ["models", "delete", "--run", "blip"])
    assert theirs.exit_code == 1 and "they are another user's: ask their owner or an admin" in theirs.output
    api.set_job(reader, status="succeeded")
    r = cli("models", "delete", "--run", "blip")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == ["removed model blip@step5"]
    assert [m["name"] for m in Client(live.url, api.tokens["ann"]).models() if "blip" in m["name"]] == ["blip2@step0"]
    nothing = cli("models", "delete", "--run", "blip")
    # run twice (a clean-up script): said plainly, exit 1, not a usage error
    assert nothing.exit_code == 1 and "no checkpoints of a training run 'blip'" in nothing.output
    assert "Usage:" not in nothing.output
    refused = cli("models", "delete", "tiny-gpt2")
    assert refused.exit_code == 1 and "built in" in refused.output


def test_datasets_delete_removes_an_upload(api, cli, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("alpha beta\n\ngamma delta\n")
    assert cli("datasets", "upload", "notes", str(text)).exit_code == 0
    r = cli("datasets", "delete", "notes")
    assert r.exit_code == 0 and r.stdout.strip() == "removed dataset notes"
    gone = cli("datasets", "delete", "notes")
    assert gone.exit_code == 1 and "no dataset 'notes'" in gone.output


def test_an_upload_read_as_one_document_says_how_to_read_it_by_lines(api, cli, tmp_path):
    """WikiText's raw files (a paragraph per line, CRLF, no blank line between) are one document in the default
    text format: the CLI says so and names --format lines, which reads a document per line."""
    lines = tmp_path / "wiki.raw"
    lines.write_bytes(b"".join(b" = Heading %d = \r\n A paragraph of words number %d .\r\n" % (i, i) for i in range(8)))
    r = cli("datasets", "upload", "wiki", str(lines))
    assert r.exit_code == 0 and "1 document," in r.stdout
    assert "--format lines" in r.stderr and "none between its lines" in r.stderr
    by_line = cli("datasets", "upload", "wiki-lines", str(lines), "--format", "lines")
    assert by_line.exit_code == 0 and "8 documents" in by_line.stdout and not by_line.stderr  # headings are none
    paragraphs = tmp_path / "notes.txt"
    paragraphs.write_text("".join(f"paragraph {i} of words\n\n" for i in range(12)))
    quiet = cli("datasets", "upload", "notes", str(paragraphs))
    assert quiet.exit_code == 0 and "12 documents" in quiet.stdout and not quiet.stderr


def test_cancel_says_what_happens_to_a_sweep(api, cli):
    """A sweep's cancel cancels its queued grid points at once and ends when its running ones have; the CLI
    said "stops at its next batch", which a sweep has none of. A queued plain job is cancelled at once."""
    h = api.user("ann")
    sweep = api.submit(h, kind="sweep", params={"grid": {"latent_dim": [1, 2], "token_dim": [1]}}).get_json()["id"]
    r = cli("cancel", str(sweep))
    assert r.exit_code == 0 and "its queued grid points are cancelled now" in r.output, r.output
    queued = api.submit(h).get_json()["id"]
    assert cli("cancel", str(queued)).output.strip() == f"job {queued}: cancelled"
    # a running job reads the flag at its next batch, unless it finishes first (then it keeps its result)
    running = api.submit(h).get_json()["id"]
    api.set_job(running, status="running")
    said = cli("cancel", str(running)).output.strip()
    assert said.startswith(f"job {running}: cancel requested (stops at its next batch") and \
        f"`lmscope wait {running}` says how it ended" in said, said


def test_submit_runs_an_earlier_job_again_with_changes(api, cli):
    """--params job:ID: the earlier job's params as its row keeps them (defaults written out), changed by -p;
    not its name or tags. A job of another kind, someone else's job, or not a number: refused, saying what to do."""
    first = api.submit(api.user("ann"), kind="norms", name="first", tags=["baseline"],
                       params={"model": "m", "dataset": "d", "max_tokens": 64, "loss_filter": None}).get_json()
    r = cli("submit", "norms", "--params", f"job:{first['id']}", "-p", "max_samples=7")
    assert r.exit_code == 0, r.output
    again = api.jobs()[-1]
    assert again.id == int(r.stdout) and again.id != first["id"]
    # every parameter as before (an explicit null too: loss_filter's default is 1.0), max_samples changed
    assert again.params == {**first["params"], "max_samples": 7}
    assert first["params"]["max_tokens"] == 64 and first["params"]["loss_filter"] is None
    assert again.name is None and again.tags == []

    shown = cli("show", str(first["id"])).stdout  # how to, where a job is shown
    assert f"run again    lmscope submit norms --params job:{first['id']}  (-p KEY=VALUE changes one)" in shown

    r = cli("submit", "probe", "--params", f"job:{first['id']}")
    assert r.exit_code == 2 and f"job {first['id']} is a norms job, not probe" in r.output
    assert f"lmscope submit norms --params job:{first['id']}" in r.output
    entropy_job = api.submit(api.user("ann"), kind="entropy", params={"model": "m", "dataset": "d"}).get_json()["id"]
    r = cli("submit", "norms", "--params", f"job:{entropy_job}")
    assert r.exit_code == 2 and f"job {entropy_job} is an entropy job, not norms" in r.output
    r = cli("submit", "norms", "--params", "job:first")
    assert r.exit_code == 2 and "job:ID takes a job's number, e.g. job:42" in r.output
    bob_job = api.submit(api.user("bob"), kind="norms", params={"model": "m", "dataset": "d"}).get_json()["id"]
    r = cli("submit", "norms", "--params", f"job:{bob_job}")
    assert r.exit_code == 1 and "not found" in r.output.lower(), r.output
    assert len(api.jobs()) == 4  # nothing submitted by the refusals

    # An entropy job's model becomes a list of models: the one it had set to null, as the docs say.
    api.add_model("m2")
    one = api.submit(api.user("ann"), kind="entropy", params={"model": "m", "dataset": "d"}).get_json()
    r = cli("submit", "entropy", "--params", f"job:{one['id']}", "-p", 'models=["m", "m2"]')
    assert r.exit_code == 1 and "got model and models (set all but one to null)" in r.output, r.output
    r = cli("submit", "entropy", "--params", f"job:{one['id']}", "-p", "model=null", "-p", 'models=["m", "m2"]')
    assert r.exit_code == 0, r.output
    assert api.jobs()[-1].params == {**one["params"], "model": None, "models": ["m", "m2"]}


def test_delete_removes_ended_jobs_and_keeps_the_others_saying_why(api, cli):
    h = api.user("ann")
    ended, queued = api.submit(h).get_json()["id"], api.submit(h).get_json()["id"]
    api.set_job(ended, status="succeeded")
    folder = api.settings.job_dir(ended)
    folder.mkdir(parents=True)
    (folder / "norms.npz").write_bytes(bytes(3 * 1024))
    sweep = api.submit(h, kind="sweep", params={"grid": {"latent_dim": [1, 2], "token_dim": [1]}}).get_json()["id"]
    for job in api.jobs():
        if job.id not in (ended, queued):
            api.set_job(job.id, status="succeeded")
    r = cli("delete", str(ended), str(queued), str(sweep))
    assert r.exit_code == 1, r.output  # one was kept
    lines = r.output.splitlines()
    assert f"deleted job {ended} (3.0 KiB of files freed)" in lines
    assert f"deleted job {sweep} and its 2 grid points (0 bytes of files freed)" in lines
    assert any(line.startswith(f"kept job {queued}: Job not ended: job {queued} is queued") for line in lines)
    assert [j.id for j in api.jobs() if j.deleted_at is None] == [queued]
    assert cli("delete", str(queued)).exit_code == 1
    r = cli("delete", str(ended), "999")
    assert r.exit_code == 1
    assert r.output.splitlines()[0].startswith(f"job {ended} was already deleted: Job deleted: job {ended} (probe)")
    assert r.output.splitlines()[1].startswith("no job 999: Job not found")
    r = cli("show", str(ended))
    assert r.exit_code == 1 and f"job {ended} (probe) was deleted on" in r.output


def test_delete_by_filter_lists_your_ended_jobs_asks_then_deletes_them(api, cli):
    h, bob = api.user("ann"), api.user("bob")
    failed = [api.submit(h, tags=["t"]).get_json()["id"] for _ in range(2)]
    other_tag, running = api.submit(h).get_json()["id"], api.submit(h, tags=["t"]).get_json()["id"]
    bobs = api.submit(bob, tags=["t"]).get_json()["id"]
    for job in failed + [other_tag, bobs]:
        api.set_job(job, status="failed")
    api.set_job(running, status="running")

    r = cli("delete", "--tag", "t", input="n\n")
    assert r.exit_code == 1
    listed = [int(line.split()[0]) for line in r.output.splitlines() if line[:1].isdigit()]
    assert listed == sorted(failed, reverse=True)  # not the untagged one, the running one, or bob's
    assert "Delete 2 jobs with their results and files, for good? [y/N]" in r.output
    assert all(j.deleted_at is None for j in api.jobs())
    r = cli("delete", "--tag", "t", "--status", "failed", "--yes")
    assert r.exit_code == 0, r.output
    assert {j.id for j in api.jobs() if j.deleted_at is not None} == set(failed)
    r = cli("delete", "--status", "running")
    assert r.exit_code == 2 and "only ended jobs can be deleted" in r.output
    assert cli("delete", "3", "--kind", "probe").exit_code == 2
    r = cli("delete", "--tag", "t")
    assert r.exit_code == 0 and "no ended job of yours matches" in r.output


def test_an_admins_delete_by_filter_keeps_to_their_own_jobs(api, live):
    """An admin lists everyone's jobs; a clean-up by filter must not sweep other users' away."""
    ann, root = api.user("ann"), api.user("root", admin=True)
    anns, roots = api.submit(ann).get_json()["id"], api.submit(root).get_json()["id"]
    for job in (anns, roots):
        api.set_job(job, status="failed")
    r = CliRunner(env={"LMSCOPE_URL": live.url, "LMSCOPE_TOKEN": api.tokens["root"]}).invoke(
        main, ["delete", "--status", "failed", "--yes"])
    assert r.exit_code == 0, r.output
    assert [j.id for j in api.jobs() if j.deleted_at is not None] == [roots]
