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

    def run(*args):
        return CliRunner(env=env).invoke(main, list(args))

    return run


def test_whoami_shows_the_limits_and_where_they_come_from(api, cli):
    from sqlalchemy import update

    from lmscope.db.models import User

    with api.sessions.begin() as session:
        session.execute(update(User).where(User.name == "ann").values(max_sweep_points=3))
    api.submit(api.user("ann"))
    r = cli("whoami")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == "ann: 1 active job(s); max_active_jobs=5 (server default), max_sweep_points=3"


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
    sweep = cli("kinds", "sweep").output
    assert "grid.latent_dim" in sweep and "train.epochs" in sweep and "one of poly_sumformer" in sweep
    missing = cli("kinds", "nrms")
    assert missing.exit_code == 1 and "no kind 'nrms'" in missing.output and "norms" in missing.output


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
    assert sorted(ids("--parent", str(sweep))[1]) == sorted(kids)


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
