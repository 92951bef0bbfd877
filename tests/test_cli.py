"""The `lmscope` command: parameter parsing, user management, and a real `lmscope up` session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from lmscope.cli import build_params, main, parse_param, parse_value

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- parameters

def test_values_are_json_when_they_parse_else_strings():
    assert parse_value("4") == 4 and parse_value("1e-3") == 0.001 and parse_value("true") is True
    assert parse_value("null") is None and parse_value("[1, 2]") == [1, 2] and parse_value('{"a": 1}') == {"a": 1}
    assert parse_value("tiny-gpt2") == "tiny-gpt2" and parse_value('"4"') == "4" and parse_value("") == ""


def test_nan_and_infinity_are_usage_errors_not_tracebacks(monkeypatch):
    """json.loads takes NaN; requests then failed to encode it, with a traceback."""
    from lmscope.params import KINDS

    norms = KINDS["norms"].params.model_json_schema()
    for text in ("NaN", "Infinity", "-Infinity", "1e999", "[1, NaN]"):
        with pytest.raises(click.BadParameter, match="not a JSON number|too large"):
            parse_value(text)
        with pytest.raises(click.BadParameter):
            parse_param(text, norms, "loss_filter")
    assert parse_param("NaN", norms, "model") == "NaN"  # a string field keeps its text
    assert parse_value("nan") == "nan"  # not JSON at all: a string, as before
    monkeypatch.setenv("LMSCOPE_URL", "http://127.0.0.1:9")  # nothing listens: the refusal comes first
    r = CliRunner().invoke(main, ["submit", "norms", "-p", "model=m", "-p", "loss_filter=NaN"])
    assert r.exit_code == 2 and "'NaN': NaN is not a JSON number" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_malformed_lmscope_url_is_one_line_saying_what_to_set(monkeypatch):
    for url in ("notaurl", "ftp://host", "http://"):
        monkeypatch.setenv("LMSCOPE_URL", url)
        r = CliRunner().invoke(main, ["jobs"])
        assert r.exit_code == 1 and "Invalid API address" in r.output and "LMSCOPE_URL" in r.output, url
        assert isinstance(r.exception, SystemExit), r.exception


def test_dotted_keys_nest_and_params_files_are_the_base(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"model": "a", "train": {"epochs": 1, "lr": 0.1}}))
    params = build_params(("model=b", "train.epochs=5", "grid.latent_dim=[2,4]", "note=x=y"), str(f))
    assert params == {"model": "b", "train": {"epochs": 5, "lr": 0.1}, "grid": {"latent_dim": [2, 4]}, "note": "x=y"}
    for bad in (("novalue",), ("=3",), ("a=1", "a.b=2"), ("a..b=1",)):
        with pytest.raises(click.BadParameter):
            build_params(bad, None)
    f.write_text("[1]")
    with pytest.raises(click.BadParameter):
        build_params((), str(f))


def test_string_fields_keep_the_text_of_their_values():
    """With the kind's schema (GET /v1/kinds), `model=123` stays "123"; other fields still parse as JSON."""
    from lmscope.params import KINDS

    train = KINDS["train"].params.model_json_schema()
    sweep = KINDS["sweep"].params.model_json_schema()
    assert parse_param("123", train, "dataset") == "123" and parse_param("007", train, "run_name") == "007"
    assert parse_param("null", train, "run_name") is None  # `str | None`: null still means "the default"
    assert parse_param('"9"', train, "dataset") == "9" and parse_param("12", train, "layers") == 12
    assert parse_param("3e-4", sweep, "train.lr") == 3e-4  # nested through $defs
    assert parse_param("5", sweep, "model") == "5" and parse_param("[2,4]", sweep, "grid.latent_dim") == [2, 4]
    assert parse_param('["a"]', sweep, "target") == ["a"]  # `str | list[str]`: JSON as before
    assert parse_param("5", sweep, "no.such.field") == 5 and parse_param("5", None, "model") == 5
    assert build_params(("model=123", "train.epochs=5"), None, sweep) == {"model": "123", "train": {"epochs": 5}}


def test_up_is_quiet_and_names_the_dashboard_and_docs(sqlite_url, settings_factory, monkeypatch, caplog, capsys):
    """`lmscope up` used to print alembic's INFO lines first; its ready line names / and /docs."""
    import logging

    import werkzeug.serving

    from lmscope.worker.embedded import serve

    class Server:  # serve_forever returns at once: start-up, the ready line, shutdown
        port = 18765

        def serve_forever(self):
            pass

        def server_close(self):
            pass

    monkeypatch.setattr(werkzeug.serving, "make_server", lambda *a, **k: Server())
    caplog.set_level(logging.INFO)
    serve(settings_factory(database_url=sqlite_url, auth=False))
    assert not [r for r in caplog.records if r.name.startswith("alembic") and r.levelno < logging.WARNING]
    out = capsys.readouterr().out
    assert "http://127.0.0.1:18765/ " in out and "http://127.0.0.1:18765/docs" in out


def test_server_commands_exist():
    assert {"up", "worker", "db", "user", "submit", "jobs", "show", "cancel", "results", "fetch", "models",
            "datasets", "whoami"} <= set(main.commands)
    assert "upgrade" in main.commands["db"].commands
    assert {"create", "token", "tokens", "revoke", "list", "limits"} <= set(main.commands["user"].commands)


def test_db_upgrade_says_what_it_did(tmp_path, monkeypatch):
    """An empty database is created (it used to say "up to date" for that too); a second run changes nothing."""
    from alembic.script import ScriptDirectory

    from lmscope.db.engine import alembic_config

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    monkeypatch.setenv("LMSCOPE_DATABASE_URL", f"sqlite:///{tmp_path / 'fresh.db'}")
    first = CliRunner().invoke(main, ["db", "upgrade"])
    assert first.exit_code == 0 and first.output.strip() == f"database created: now at revision {head}"
    again = CliRunner().invoke(main, ["db", "upgrade"])
    assert again.output.strip() == f"database is up to date (revision {head})"


# ---------------------------------------------------------------- users (direct database access)

def test_datasets_add_registers_a_server_file_without_upload(sqlite_url, tmp_path, monkeypatch):
    """`lmscope datasets add` (for corpora past the upload limit, e.g. WikiText-103): one document per line,
    headings dropped, counted and hashed like an upload; a taken name and a non-UTF-8 file are refused."""
    import hashlib

    from sqlalchemy import create_engine, select

    from lmscope.db.models import Dataset

    monkeypatch.setenv("LMSCOPE_DATABASE_URL", sqlite_url)
    corpus = tmp_path / "wiki.train.raw"
    body = " = Title = \r\n First paragraph .\r\n\r\n = = Section = = \r\n Second one .\r\n Third .\r\n"
    corpus.write_bytes(body.encode())
    runner = CliRunner()
    added = runner.invoke(main, ["datasets", "add", "wt103", str(corpus), "--format", "lines"])
    assert added.exit_code == 0, added.output
    assert "3 documents" in added.output
    with create_engine(sqlite_url).connect() as c:
        row = c.execute(select(Dataset).where(Dataset.name == "wt103")).one()
    assert (row.num_documents, row.num_bytes, row.format) == (3, len(body.encode()), "lines")
    assert row.sha256 == hashlib.sha256(body.encode()).hexdigest() and row.path == str(corpus.resolve())
    empty = tmp_path / "empty.raw"
    empty.write_text(" = Only a heading = \n\n")
    refused = runner.invoke(main, ["datasets", "add", "nothing", str(empty), "--format", "lines"])
    assert refused.exit_code != 0 and "has no documents in format 'lines'" in refused.output  # as an upload

    again = runner.invoke(main, ["datasets", "add", "wt103", str(corpus)])
    assert again.exit_code != 0 and "exists" in again.output
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    bad = runner.invoke(main, ["datasets", "add", "latin", str(latin1)])
    assert bad.exit_code != 0 and "not UTF-8" in bad.output and "line 2" in bad.output
    # the names the API accepts for uploads, and no others
    spaced = runner.invoke(main, ["datasets", "add", "my corpus", str(corpus)])
    assert spaced.exit_code != 0 and "cannot be a name" in spaced.output
    with create_engine(sqlite_url).connect() as c:
        assert c.execute(select(Dataset.name)).scalars().all() == ["wt103"]


def test_user_names_follow_the_apis_naming_rule(sqlite_url, monkeypatch):
    """`lmscope user create ''` and `'a b'` used to succeed; such names cannot be given to `?user=`."""
    from sqlalchemy import create_engine, select

    from lmscope.db.models import User

    monkeypatch.setenv("LMSCOPE_DATABASE_URL", sqlite_url)
    runner = CliRunner()
    for bad in ("", "a b", "tab\tname", ".dot", "x" * 65):
        r = runner.invoke(main, ["user", "create", bad])
        assert r.exit_code == 1 and "cannot be a user name" in r.output and "at most 64" in r.output, bad
    assert runner.invoke(main, ["user", "create", "alice@example.org"]).exit_code == 0
    with create_engine(sqlite_url).connect() as c:
        assert c.execute(select(User.name)).scalars().all() == ["alice@example.org"]


def test_user_limits_are_set_shown_and_reset(sqlite_url, monkeypatch):
    from sqlalchemy import select

    from lmscope.db.engine import make_engine, make_sessionmaker
    from lmscope.db.models import User

    monkeypatch.setenv("LMSCOPE_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("LMSCOPE_MAX_SWEEP_POINTS", "64")
    runner = CliRunner()
    assert runner.invoke(main, ["user", "create", "ann", "--max-sweep-points", "500"]).exit_code == 0
    assert runner.invoke(main, ["user", "create", "bob"]).exit_code == 0

    def limits(name):
        with make_sessionmaker(make_engine(sqlite_url))() as s:
            u = s.scalar(select(User).where(User.name == name))
            return u.max_active_jobs, u.max_sweep_points

    assert limits("ann") == (None, 500) and limits("bob") == (None, None)
    shown = runner.invoke(main, ["user", "limits", "bob", "--max-active-jobs", "3"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.strip() == "bob: max_active_jobs=3, max_sweep_points=64 (server default)"
    assert limits("bob") == (3, None)
    assert runner.invoke(main, ["user", "limits", "ann", "--max-sweep-points", "Default"]).exit_code == 0
    assert limits("ann") == (None, None)
    for bad in ("0", "-2", "many", "1_000", "2147483648"):
        r = runner.invoke(main, ["user", "limits", "bob", "--max-active-jobs", bad])
        assert r.exit_code == 2 and "is not a positive integer" in r.output and "'default'" in r.output, bad
    assert limits("bob") == (3, None)
    missing = runner.invoke(main, ["user", "limits", "nobody"])
    assert missing.exit_code == 1 and "no user 'nobody'" in missing.output
    listed = runner.invoke(main, ["user", "list"]).output.splitlines()
    assert listed[1].startswith("bob") and "max_active_jobs=3," in listed[1]


def test_server_commands_name_the_database_they_cannot_use(tmp_path, monkeypatch):
    """`lmscope user create` in a shell without the service's LMSCOPE_DATA_DIR used to print a
    60-line traceback ("no such table: users") and leave an empty lmscope.db behind."""
    from lmscope.db.engine import upgrade

    runner = CliRunner()
    missing = tmp_path / "nowhere" / "lmscope.db"
    monkeypatch.setenv("LMSCOPE_DATABASE_URL", f"sqlite:///{missing}")
    r = runner.invoke(main, ["user", "create", "dave"])
    assert r.exit_code == 1 and f"no database at sqlite:///{missing}" in r.output and "LMSCOPE_DATA_DIR" in r.output
    assert not missing.exists() and "Traceback" not in r.output
    old = tmp_path / "old.db"
    upgrade(f"sqlite:///{old}", "0001")
    monkeypatch.setenv("LMSCOPE_DATABASE_URL", f"sqlite:///{old}")
    r = runner.invoke(main, ["user", "list"])
    assert r.exit_code == 1 and "schema revision 0001" in r.output and "lmscope db upgrade" in r.output
    assert runner.invoke(main, ["db", "upgrade"]).exit_code == 0
    assert runner.invoke(main, ["user", "create", "dave"]).exit_code == 0


def test_user_create_prints_a_working_token(sqlite_url, settings_factory, monkeypatch):
    from lmscope.api import create_app

    monkeypatch.setenv("LMSCOPE_DATABASE_URL", sqlite_url)
    runner = CliRunner()
    created = runner.invoke(main, ["user", "create", "ann", "--admin"])
    assert created.exit_code == 0, created.output
    token = created.stdout.strip()
    assert token.startswith("lms_") and len(token) > 40
    another = runner.invoke(main, ["user", "token", "ann"]).stdout.strip()
    assert another.startswith("lms_") and another != token
    again = runner.invoke(main, ["user", "create", "ann"])
    assert again.exit_code != 0 and "exists" in again.output
    assert runner.invoke(main, ["user", "token", "nobody"]).exit_code != 0

    class Nowhere:
        def publish(self, job_id):
            pass

    app = create_app(settings_factory(database_url=sqlite_url, auth=True), publisher=Nowhere())
    client = app.test_client()
    for t in (token, another):
        r = client.get("/v1/jobs", headers={"Authorization": f"Bearer {t}"})
        assert r.status_code == 200, r.get_json()
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer lms_forged"}).status_code == 401

    # A leaked token is revoked by its prefix (or whole); the user's other tokens keep working.
    listed = runner.invoke(main, ["user", "tokens", "ann"]).stdout.splitlines()
    assert [line.split("…")[0] for line in listed] == [token[:12], another[:12]]
    assert "never" not in listed[0] and all("last used" in line for line in listed)
    assert runner.invoke(main, ["user", "revoke", "ann", "--token", "lms_"]).exit_code != 0  # matches both
    assert runner.invoke(main, ["user", "revoke", "ann"]).exit_code != 0  # says which token
    assert runner.invoke(main, ["user", "revoke", "ann", "--token", token[:12]]).exit_code == 0
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {another}"}).status_code == 200
    assert runner.invoke(main, ["user", "revoke", "ann", "--token", another]).exit_code == 0
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {another}"}).status_code == 401
    gone = runner.invoke(main, ["user", "revoke", "ann", "--token", another[:12]])
    assert gone.exit_code != 0 and "no token starting" in gone.output
    third = runner.invoke(main, ["user", "token", "ann"]).stdout.strip()
    assert runner.invoke(main, ["user", "revoke", "ann", "--all"]).exit_code == 0
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {third}"}).status_code == 401


# ---------------------------------------------------------------- against a real `lmscope up`

def lmscope(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "lmscope.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_submit_wait_fetch_against_lmscope_up(lmscope_up, tmp_path):
    env = lmscope_up
    done = lmscope(env, "submit", "probe", "--param", "model=tiny-gpt2", "--tag", "cli", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    # Progress on stderr (stage, done/total, %), the outcome on stdout.
    assert "submitted job 1 (probe)" in done.stderr
    assert "3/3" in done.stderr and "100.0%" in done.stderr
    assert "job 1 (probe) succeeded" in done.stdout
    assert "num_layers: 4" in done.stdout  # tiny-gpt2's config (lmscope.catalog.BUILTIN_MODELS)
    assert "lmscope fetch 1 DIR" in done.stdout and ".png" in done.stdout

    fetched = lmscope(env, "fetch", "1", str(tmp_path / "out"))
    assert fetched.returncode == 0, fetched.stderr
    pngs = list((tmp_path / "out").rglob("*.png"))
    assert pngs and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)

    # `lmscope jobs` is light: it lists the job without importing torch.
    code = ("import sys; from lmscope.cli import main; main(['jobs', '--tag', 'cli'], standalone_mode=False); "
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'flask', 'sqlalchemy') if m in sys.modules]; "
            "assert not heavy, heavy")
    listed = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split()[:3] == ["ID", "KIND", "STATUS"]
    assert listed.stdout.splitlines()[1].split()[:3] == ["1", "probe", "succeeded"]

    as_json = json.loads(lmscope(env, "results", "1").stdout)
    as_csv = lmscope(env, "results", "1", "--format", "csv").stdout.splitlines()
    assert as_csv[0] == "series,labels,x,y"
    assert len(as_csv) - 1 == sum(len(s["x"]) for s in as_json["series"])

    shown = lmscope(env, "show", "1", "--json")
    assert json.loads(shown.stdout)["summary"]["num_layers"] == 4

    # Errors: the problem's title and detail, each bad field, a non-zero exit.
    bad = lmscope(env, "submit", "probe", "--param", "model=ghost")
    assert bad.returncode == 1 and "Unknown model" in bad.stderr and "params.model: model 'ghost'" in bad.stderr
    missing = lmscope(env, "show", "99")
    assert missing.returncode == 1 and "Job not found" in missing.stderr
    finished = lmscope(env, "cancel", "1")
    assert finished.returncode == 1 and "Job already finished" in finished.stderr and "succeeded" in finished.stderr
