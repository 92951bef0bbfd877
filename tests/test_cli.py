"""The `lmscope` command: parameter parsing, user management, and a real `lmscope up` session."""

from __future__ import annotations

import csv
import json
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from lmscope import __version__
from lmscope.cli import build_params, example_command, main, parse_param, parse_value, summary_value
from lmscope.params import KINDS, validate_params

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- parameters

def test_values_are_json_when_they_parse_else_strings():
    assert parse_value("4") == 4 and parse_value("1e-3") == 0.001 and parse_value("true") is True
    assert parse_value("null") is None and parse_value("[1, 2]") == [1, 2] and parse_value('{"a": 1}') == {"a": 1}
    assert parse_value("tiny-gpt2") == "tiny-gpt2" and parse_value('"4"') == "4" and parse_value("") == ""


def test_nan_and_infinity_are_usage_errors_not_tracebacks(monkeypatch):
    """json.loads takes NaN; requests then failed to encode it, with a traceback."""
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


def test_summary_values_print_as_written():
    """`submit --wait` prints each summary value: strings bare, floats to 6 digits, the rest as JSON with
    its text as written (a note "≤ loss_filter" or a head "α" is not \\u-escaped)."""
    assert summary_value("kept ≤ 1.0") == "kept ≤ 1.0" and summary_value(0.123456789) == "0.123457"
    assert summary_value(["α", None, True]) == '["α", null, true]'


def test_timeout_without_wait_is_refused_before_submitting(monkeypatch):
    """--timeout only limits --wait: alone it did nothing, silently."""
    monkeypatch.setenv("LMSCOPE_URL", "http://127.0.0.1:9")  # nothing listens: the refusal comes first
    r = CliRunner().invoke(main, ["submit", "probe", "-p", "model=m", "--timeout", "5"])
    assert r.exit_code == 2 and "--timeout limits --wait" in r.output


def test_python_dash_m_lmscope_is_the_cli():
    run = subprocess.run([sys.executable, "-m", "lmscope", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == f"lmscope {__version__}", run.stderr


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
    # the other order used to drop model.x unseen; a --params object is still the base -p replaces
    with pytest.raises(click.BadParameter, match="'model' is given a value and also 'model.x'"):
        build_params(("model.x=1", "model=tiny-gpt2"), None)
    assert build_params(("train=3",), str(f)) == {"model": "a", "train": 3}
    # a key given twice: the later value used to win unseen; over a --params value one -p is fine
    with pytest.raises(click.BadParameter, match=r"'seq_len' is given twice \('seq_len=128' and 'seq_len=256'\)"):
        build_params(("seq_len=128", "seq_len=256"), None)
    with pytest.raises(click.BadParameter, match="'train.lr' is given twice"):
        build_params(("train.lr=0.1", "train.lr=0.2"), str(f))
    # an object, then one of its fields: the field used to win unseen (and the object to drop the file's others)
    with pytest.raises(click.BadParameter, match="'train' is given a value and also 'train.epochs'"):
        build_params(('train={"epochs": 3}', "train.epochs=5"), str(f))
    assert build_params(("train.epochs=5",), str(f))["train"] == {"epochs": 5, "lr": 0.1}  # the file's lr kept
    assert build_params(("model=c",), str(f))["model"] == "c"
    f.write_text("[1]")
    with pytest.raises(click.BadParameter):
        build_params((), str(f))


EXAMPLE_KINDS = {  # every bundled example and the kind it is for; what its users add to it
    "attention_study": ("sweep", {}), "attention_study_demo": ("sweep", {}), "fig1": ("sweep", {}),
    "fig2": ("sweep", {}), "fig2_full": ("sweep", {}), "norms_demo": ("norms", {"model": "m"}),
    "entropy_demo": ("entropy", {"train_job": 1}), "entropy_dynamics": ("entropy", {"train_job": 1}),
    "pruning_demo": ("pruning", {"model": "m"}), "operator_demo": ("operator", {"train_job": 1}), "train_demo": ("train", {}), "train_entropy_dynamics": ("train", {}),
}


def test_every_bundled_example_is_valid_for_its_kind():
    """An example the docs point to must submit: a renamed or tightened parameter breaks it here first."""
    from lmscope import examples

    assert sorted(EXAMPLE_KINDS) == examples.names()  # a new example gets its kind here
    for name, (kind, added) in EXAMPLE_KINDS.items():
        params = json.loads(examples.read_bytes(name))
        validate_params(kind, {**params, **added})


def test_bundled_examples_are_found_from_any_directory(tmp_path, monkeypatch):
    """The docs' `--params lmscope/examples/fig2.json` only worked from a checkout's root."""
    monkeypatch.chdir(tmp_path)
    on_disk = json.loads((ROOT / "lmscope" / "examples" / "fig2.json").read_text())
    assert build_params(("train.epochs=3",), "example:fig2") == {**on_disk, "train": {**on_disk["train"], "epochs": 3}}
    assert build_params((), "example:fig2.json") == on_disk
    with pytest.raises(click.BadParameter, match="--params example:fig2 .*works only from a checkout's root"):
        build_params((), "lmscope/examples/fig2.json")
    with pytest.raises(click.BadParameter, match="no bundled example 'fig3'; they are .*fig2, fig2_full"):
        build_params((), "example:fig3")
    with pytest.raises(click.BadParameter, match="file 'mine.json' does not exist$"):
        build_params((), "mine.json")


def test_a_list_that_does_not_parse_says_where_not_that_it_is_a_string():
    """`grid.latent_dim=[1,2` was sent as the string "[1,2", and the answer hinted at a list of one."""
    sweep = KINDS["sweep"].params.model_json_schema()
    with pytest.raises(click.BadParameter, match=r"grid.latent_dim=\[1,2 starts like JSON but does not parse: "
                                                 r"Expecting ',' delimiter at line 1, column 5"):
        parse_param("[1,2", sweep, "grid.latent_dim")
    assert parse_param("[1,2]", sweep, "grid.latent_dim") == [1, 2]
    probe = KINDS["probe"].params.model_json_schema()
    assert parse_param("[INST] hi", probe, "prompt") == "[INST] hi"  # a text field keeps any text
    assert parse_value("[x") == "[x" and parse_param("[INST] hi", None, "prompt") == "[INST] hi"  # no schema: text


def test_string_fields_keep_the_text_of_their_values():
    """With the kind's schema (GET /v1/kinds), `model=123` stays "123"; other fields still parse as JSON."""
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

    from lmscope.up import serve

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


def test_up_refuses_a_port_out_of_range_naming_the_flag_or_variable(monkeypatch):
    """-1 was an OverflowError traceback; 65536 and 70000 (also as LMSCOPE_PORT) quietly bound another port."""
    import lmscope.up

    served = []
    monkeypatch.setattr(lmscope.up, "serve", served.append)
    monkeypatch.delenv("LMSCOPE_PORT", raising=False)
    for port in ("-1", "65536", "70000"):
        r = CliRunner().invoke(main, ["up", "--port", port])
        assert r.exit_code == 2 and f"Invalid value for '--port': {port} is not in the range 0<=x<=65535" in r.output
    r = CliRunner(env={"LMSCOPE_PORT": "70000"}).invoke(main, ["up"])
    assert r.exit_code == 1 and "LMSCOPE_PORT=70000 is not a port (0 to 65535)" in r.output
    assert isinstance(r.exception, SystemExit) and served == []
    assert CliRunner(env={"LMSCOPE_PORT": "70000"}).invoke(main, ["up", "--port", "0"]).exit_code == 0
    assert [s.port for s in served] == [0]  # --port wins over the variable; 0 picks a free port


def test_up_on_port_0_names_the_port_it_got(sqlite_url, settings_factory, monkeypatch, capsys):
    import werkzeug.serving

    from lmscope.up import serve

    real, made = werkzeug.serving.make_server, []

    def make_server(*args, **kwargs):  # a real bind, but serve_forever returns at once
        made.append(real(*args, **kwargs))
        made[-1].serve_forever = lambda: None
        return made[-1]

    monkeypatch.setattr(werkzeug.serving, "make_server", make_server)
    serve(settings_factory(database_url=sqlite_url, auth=False, port=0))
    assert made[0].port != 0 and f"dashboard http://127.0.0.1:{made[0].port}/ " in capsys.readouterr().out
    # an IPv6 address is written in brackets in a URL (http://::1:8765/ is not one)
    try:
        serve(settings_factory(database_url=sqlite_url, auth=False, port=0, host="::1"))
    except SystemExit as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    assert f"dashboard http://[::1]:{made[-1].port}/ " in capsys.readouterr().out


def test_a_token_a_header_cannot_carry_is_one_line_not_a_traceback(monkeypatch):
    """requests raised InvalidHeader (a newline) or UnicodeEncodeError (€) from the first request."""
    monkeypatch.setenv("LMSCOPE_URL", "http://127.0.0.1:9")
    for token, shown in (("lms_ab\ncd", "'\\n' at position 6"), ("lms_€x", "'€' at position 4")):
        r = CliRunner(env={"LMSCOPE_TOKEN": token}).invoke(main, ["jobs"])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
        assert r.output.strip() == (f"Error: Invalid API token: LMSCOPE_TOKEN holds a character a header cannot "
                                    f"carry ({shown}); copy the token again (it looks like lms_ followed by "
                                    "letters, digits, - and _)")
        assert token not in r.output  # a secret: only the bad character is shown


def test_submit_refuses_a_negative_timeout_and_an_empty_idempotency_key(monkeypatch):
    """-5 was taken ("still running after -5.0 s"); '' sent no key at all; a newline or € was a traceback."""
    monkeypatch.setenv("LMSCOPE_URL", "http://127.0.0.1:9")  # nothing listens: the refusal comes first
    for args in (["submit", "probe", "--wait", "--timeout", "-5"], ["wait", "1", "--timeout", "nan"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "Invalid value for '--timeout'" in r.output and "0 or more" in r.output, args
    for key, says in (("", "the key is empty"), ("  ", "the key is empty"), ("a\nb", "not 1 to 200 printable"),
                      ("€", "not 1 to 200 printable"), ("k" * 201, "not 1 to 200 printable")):
        r = CliRunner().invoke(main, ["submit", "probe", "--idempotency-key", key])
        assert r.exit_code == 2 and "Invalid value for '--idempotency-key'" in r.output and says in r.output, key


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
    monkeypatch.setenv("LMSCOPE_DATABASE_URL", f"sqlite:///{tmp_path / 'data' / 'fresh.db'}")
    first = CliRunner().invoke(main, ["db", "upgrade"])
    assert first.exit_code == 0 and first.output.strip() == f"database created: now at revision {head}"
    assert (tmp_path / "data").stat().st_mode & 0o077 == 0  # the folder it made is private (tokens, results)
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


def test_the_server_keeps_only_each_tokens_sha256(tmp_path, monkeypatch):
    """docs/api.md: a token is shown once and only its sha256 is stored, so a copy of the database
    (a backup, a dump) gives no one a working token."""
    import hashlib

    from sqlalchemy import create_engine, select

    from lmscope.db.engine import upgrade
    from lmscope.db.models import ApiToken

    db = tmp_path / "lmscope.db"
    upgrade(f"sqlite:///{db}")
    monkeypatch.setenv("LMSCOPE_DATABASE_URL", f"sqlite:///{db}")
    runner = CliRunner()
    first = runner.invoke(main, ["user", "create", "ann"]).stdout.strip()
    second = runner.invoke(main, ["user", "token", "ann"]).stdout.strip()
    assert first.startswith("lms_") and second.startswith("lms_") and first != second
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as c:
        stored = set(c.execute(select(ApiToken.token_hash)).scalars())
    engine.dispose()
    assert stored == {hashlib.sha256(t.encode()).hexdigest() for t in (first, second)}
    files = b"".join(p.read_bytes() for p in tmp_path.glob("lmscope.db*"))  # the WAL too
    for token in (first, second):
        assert token.encode() not in files and token[12:].encode() not in files


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
    from lmscope.db.engine import head_revision, upgrade

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
    # migrated by a newer lmscope: `lmscope db upgrade` cannot mend that, so it is not what the error says
    with sqlite3.connect(old) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    r = runner.invoke(main, ["user", "list"])
    assert r.exit_code == 1 and "9999_from_the_future" in r.output and "run the newer lmscope" in r.output
    assert "db upgrade" not in r.output
    # nor can `lmscope db upgrade` itself: it says so in one line (it printed alembic's traceback)
    r = runner.invoke(main, ["db", "upgrade"])
    assert r.exit_code == 1 and r.exception.__class__ is SystemExit, r.output
    assert r.output.strip() == (f"Error: sqlite:///{old}: the database has schema revision 9999_from_the_future, which this "
                                "lmscope does not know (a newer lmscope migrated it, this one needs "
                                f"{head_revision()}); "
                                "run the newer lmscope")
    with sqlite3.connect(old) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("9999_from_the_future",)]


def test_db_upgrade_of_a_database_that_does_not_answer_is_one_line_without_the_password(tmp_path, monkeypatch):
    # a PostgreSQL URL whose server is not there (a socket folder with no server in it): the driver's error,
    # one line, and the password hidden
    monkeypatch.setenv("LMSCOPE_DATABASE_URL", f"postgresql+psycopg://lmscope:s3cret@/lmscope?host={tmp_path}&port=5999")
    r = CliRunner().invoke(main, ["db", "upgrade"])
    assert r.exit_code == 1 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith("Error: postgresql+psycopg://lmscope:***@/lmscope") and "does not answer" in r.output
    assert "s3cret" not in r.output


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
        def publish(self, job_id, *, aggregation=False):
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
    # Only the 12 characters shown (or the whole token) name a token: shorter ones matched one token only
    # (and revoked it), longer ones could match none; both are refused, saying what to give.
    for wrong in ("lms_", token[:11], token[:13], token[:-1]):
        r = runner.invoke(main, ["user", "revoke", "ann", "--token", wrong])
        assert r.exit_code == 2 and "first 12 characters" in r.output, r.output
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
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


def test_a_kinds_example_command_builds_exactly_its_example():
    """`lmscope kinds KIND` ends with a command to submit the kind's example: read back as a shell and the CLI
    read it, its -p pairs make that example, which is valid params."""
    for kind, spec in KINDS.items():
        if not spec.submittable:
            continue
        words = shlex.split(example_command(kind, spec.example))
        assert words[:3] == ["lmscope", "submit", kind] and set(words[3::2]) == {"-p"}, words
        assert build_params(tuple(words[4::2]), None, spec.params.model_json_schema()) == spec.example, kind
        validate_params(kind, spec.example)


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
    # row by row the JSON's points: name, each label in a column of its own, what x is, x, y, in order
    header, *rows = list(csv.reader(as_csv))
    keys = list(dict.fromkeys(k for s in as_json["series"] for k in s["labels"]))
    assert keys and header == ["series", *keys, "x_meaning", "x", "y"]
    assert {s["x_meaning"] for s in as_json["series"] if s["name"] == "parameters.by_layer"} == {"layer"}
    expected = [(s["name"], [str(s["labels"].get(k, "")) for k in keys], s["x_meaning"], float(x), float(y))
                for s in as_json["series"] for x, y in zip(s["x"], s["y"])]
    assert [(row[0], row[1:-3], row[-3], float(row[-2]), float(row[-1])) for row in rows] == expected

    shown = lmscope(env, "show", "1", "--json")
    assert json.loads(shown.stdout)["summary"]["num_layers"] == 4

    # Errors: the problem's title and detail, each bad field, a non-zero exit.
    bad = lmscope(env, "submit", "probe", "--param", "model=ghost")
    assert bad.returncode == 1 and "Unknown model" in bad.stderr and "params.model: model 'ghost'" in bad.stderr
    missing = lmscope(env, "show", "99")
    assert missing.returncode == 1 and "Job not found" in missing.stderr
    finished = lmscope(env, "cancel", "1")
    assert finished.returncode == 1 and "Job already finished" in finished.stderr and "succeeded" in finished.stderr


# ---------------------------------------------------------------- compare and models (a stand-in server)

class _FakeApi:
    """What `lmscope compare` and `lmscope models` ask the API for, answered from fixed documents."""

    def __init__(self, jobs=(), series=(), models=()):
        self.jobs, self.series, self._models, self.calls = list(jobs), list(series), list(models), []

    def compare(self, ids, names):
        from lmscope.compare import compare

        self.calls.append(("compare", ids, names))
        c = compare(self.jobs, [[s for s in self.series[i] if not names or s["name"] in names]
                                for i in range(len(self.jobs))])
        c.missing = [n for n in names if not any(s["name"] == n for ss in self.series for s in ss)]
        c.shared_series = sorted(set.intersection(*({s["name"] for s in ss} for ss in self.series)))
        return c

    def models(self, *, run=None, source=None):
        self.calls.append(("models",))
        # as Client.models(run=R) answers: the checkpoints R@step<N>
        return [m for m in self._models if run is None or re.fullmatch(re.escape(run) + r"@step\d+", m["name"])]


LONG_NOTE = "clamped to 20 (φ has only that many monomials; all of them are used) " * 3


def _two_jobs():
    jobs = [{"id": 3, "kind": "norms", "name": None, "status": "succeeded",
             "params": {"model": "tiny-gpt2", "dataset": "wikitext-2", "layers": [0, 1]},
             "summary": {"sequence_pct": 56.0, "note": LONG_NOTE, "ok": True, "nested": {"a": 1}}},
            {"id": 4, "kind": "norms", "name": "llama run", "status": "succeeded",
             "params": {"model": "tiny-llama", "dataset": "wikitext-2", "layers": [0, 2]},
             "summary": {"sequence_pct": 54.5, "note": "short", "ok": False, "nested": {"a": 2}}}]
    series = [[{"name": "norm.mean", "labels": {"unit": "L2 norm"}, "x": [0, 1], "y": [1.0, 2.0]}],
              [{"name": "norm.mean", "labels": {"unit": "L2 norm"}, "x": [0, 1], "y": [1.5, 2.5]}]]
    return _FakeApi(jobs, series)


def test_compare_csv_without_series_is_the_side_by_side_table(monkeypatch):
    """It printed only the curves' header; now: one row per field, one column per job, values whole."""
    import csv
    import io

    api = _two_jobs()
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    r = CliRunner().invoke(main, ["compare", "3", "4", "--format", "csv"])
    assert r.exit_code == 0, r.output
    rows = list(csv.reader(io.StringIO(r.stdout)))
    assert rows == [["field", "job 3", "job 4"], ["kind", "norms", "norms"], ["status", "succeeded", "succeeded"],
                    ["name", "", "llama run"], ["params.model", "tiny-gpt2", "tiny-llama"],
                    ["params.layers", "[0, 1]", "[0, 2]"],  # the same dataset is no row
                    ["summary.sequence_pct", "56.0", "54.5"], ["summary.note", LONG_NOTE, "short"],
                    ["summary.ok", "true", "false"], ["summary.nested", '{"a": 1}', '{"a": 2}']]  # an object as JSON
    assert "norm.mean" in r.stderr  # the hint: which curves --series can name
    curves = CliRunner().invoke(main, ["compare", "3", "4", "--format", "csv", "--series", "norm.mean"])
    assert curves.stdout.splitlines()[0] == "series,unit,x_meaning,x,job 3,job 4"  # a label per column
    meaning = '"hidden state h_l (l = 0: embedding output, l: output of block l)"'  # quoted: it holds commas
    assert curves.stdout.splitlines()[1:] == [f'norm.mean,L2 norm,{meaning},0,1.0,1.5',
                                              f'norm.mean,L2 norm,{meaning},1,2.0,2.5']


def test_compare_table_writes_null_values_and_dashes_absent_ones(monkeypatch):
    api = _two_jobs()
    api.jobs[0]["params"]["loss_filter"] = None  # job 4 has no loss_filter
    api.jobs[1]["summary"]["gram_condition_pct"] = None  # job 3 has no gram_condition_pct
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    rows = {line.split()[0]: line.split()[1:] for line in CliRunner().invoke(main, ["compare", "3", "4"]).stdout.splitlines()
            if line.strip()}
    assert rows["params.loss_filter"] == ["null", "-"] and rows["gram_condition_pct"] == ["-", "null"]


def test_compare_table_puts_what_differs_first_and_says_why_a_job_failed(monkeypatch):
    """Summary values every job shares went row by row among the ones that differ; a failed job's error was
    left out. Now the shared ones come last under a heading, and an `error` row follows `status`."""
    api = _two_jobs()
    api.jobs[0]["summary"]["layers"] = api.jobs[1]["summary"]["layers"] = 12
    api.jobs[1].update(status="failed", error={"type": "out-of-memory", "message": "lower batch_size"})
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    r = CliRunner().invoke(main, ["compare", "3", "4"])
    assert r.exit_code == 0, r.output
    names = [line.split("  ")[0].strip() for line in r.stdout.splitlines() if line.strip()]
    assert names.index("error") == names.index("status") + 1
    error_line = r.stdout.splitlines()[names.index("error")]
    assert error_line.split()[1:] == ["out-of-memory:", "lower", "batch_size"]  # job 3's cell is empty
    assert names[-2:] == ["(the same in every job)", "layers"]
    assert names.index("sequence_pct") < names.index("(the same in every job)")  # 56.0 vs 54.5: differs


def test_compare_table_cuts_long_values_but_json_keeps_them(monkeypatch):
    api = _two_jobs()
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    table = CliRunner().invoke(main, ["compare", "3", "4"])
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    note = next(line for line in lines if line.startswith("note"))
    assert LONG_NOTE[:39] + "…" in note and LONG_NOTE[:41] not in note
    assert max(map(len, lines)) < 110  # it was as wide as the longest note (230 characters)
    as_json = json.loads(CliRunner().invoke(main, ["compare", "3", "4", "--format", "json"]).stdout)
    assert as_json["summary"]["note"]["3"] == LONG_NOTE and as_json["params"]["model"]["4"] == "tiny-llama"
    assert as_json["shared_series"] == ["norm.mean"] and as_json["missing"] == []


def test_compare_a_missing_series_fails_like_results(monkeypatch):
    """Every --series name missing: exit 1 (as `lmscope results`); some missing: a warning, exit 0."""
    api = _two_jobs()
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    none = CliRunner().invoke(main, ["compare", "3", "4", "--series", "nosuch"])
    assert none.exit_code == 1 and none.stdout == ""
    assert "no job has series 'nosuch'" in none.stderr and "norm.mean" in none.stderr
    some = CliRunner().invoke(main, ["compare", "3", "4", "--series", "nosuch", "--series", "norm.mean"])
    assert some.exit_code == 0 and "no job has series 'nosuch'" in some.stderr
    assert "norm.mean [unit=L2 norm]" in some.stdout


def test_compare_plot_refuses_a_format_before_asking_the_server(monkeypatch, tmp_path):
    """`--plot cmp.txt` printed the whole table, then matplotlib's "Format 'txt' is not supported"."""
    api = _two_jobs()
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    r = CliRunner().invoke(main, ["compare", "3", "4", "--series", "norm.mean", "--plot", str(tmp_path / "cmp.txt")])
    assert r.exit_code == 2 and "cannot draw a .txt file" in r.stderr and ".png" in r.stderr and ".svg" in r.stderr
    assert api.calls == [] and r.stdout == "" and not (tmp_path / "cmp.txt").exists()
    ok = CliRunner().invoke(main, ["compare", "3", "4", "--series", "norm.mean", "--plot", str(tmp_path / "cmp.PDF")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "cmp.PDF").read_bytes().startswith(b"%PDF")


def test_models_are_listed_in_natural_order(monkeypatch):
    """cx@step100 came before cx@step20 (the API sorts names as text)."""
    from lmscope.cli import natural_key

    names = ["cx@step100", "cx@step20", "Ab", "cx@step1000", "tiny-gpt2", "cx@step5", "a2", "a10"]
    api = _FakeApi(models=[{"name": n, "source": "checkpoint" if "@" in n else "builtin"} for n in sorted(names)])
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    r = CliRunner().invoke(main, ["models"])
    assert r.exit_code == 0, r.output
    listed = [line.split()[0] for line in r.stdout.splitlines()[1:]]
    assert listed == ["a2", "a10", "Ab", "cx@step5", "cx@step20", "cx@step100", "cx@step1000", "tiny-gpt2"]
    assert sorted(["x9y", "x10", "x9"], key=natural_key) == ["x9", "x9y", "x10"]
    run = CliRunner().invoke(main, ["models", "--run", "cx"])
    assert [line.split()[0] for line in run.stdout.splitlines()[1:]] == ["cx@step5", "cx@step20", "cx@step100",
                                                                         "cx@step1000"]
    assert [line.split()[0] for line in CliRunner().invoke(main, ["models", "list", "--run", "cx"])
            .stdout.splitlines()[1:]] == ["cx@step5", "cx@step20", "cx@step100", "cx@step1000"]
    nothing = CliRunner().invoke(main, ["models", "--run", "ghost"])
    assert nothing.exit_code == 0 and "no checkpoints of a training run 'ghost'" in nothing.stderr


@pytest.mark.slow
def test_every_kinds_example_runs_as_lmscope_kinds_prints_it(lmscope_up):
    """The examples are where a newcomer starts (the dashboard's form, `lmscope kinds KIND`): each one runs on the
    built-ins, on a CPU, within the --wait below."""
    for kind in [k for k, spec in KINDS.items() if spec.submittable]:
        shown = lmscope(lmscope_up, "kinds", kind)
        assert shown.returncode == 0, shown.stderr
        words = shlex.split(shown.stdout.splitlines()[-1])
        assert words[:3] == ["lmscope", "submit", kind], shown.stdout
        done = lmscope(lmscope_up, *words[1:], "--wait", timeout=300)
        assert done.returncode == 0 and f"({kind}) succeeded" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_compare_against_lmscope_up(lmscope_up, tmp_path):
    """`lmscope compare` of two real probe jobs: the csv rows are the jobs' own params and summaries (as
    `GET /v1/jobs/{id}` has them), a missing series fails as `lmscope results` does, the plot names the jobs."""
    import csv
    import io

    from lmscope.client import Client

    env = lmscope_up
    client = Client(env["LMSCOPE_URL"])
    ids = [client.submit("probe", {"model": m})["id"] for m in ("tiny-gpt2", "tiny-llama")]
    jobs = [client.wait(i, timeout=120) for i in ids]
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"]
    a, b = ids

    r = lmscope(env, "compare", str(a), str(b), "--format", "csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.reader(io.StringIO(r.stdout)))
    assert rows[0] == ["field", f"job {a}", f"job {b}"]
    got = {row[0]: row[1:] for row in rows[1:]}
    assert got["kind"] == ["probe", "probe"] and got["status"] == ["succeeded", "succeeded"]

    def same(cell, value):  # a CSV cell holds the value itself: text as it is, numbers and booleans as JSON
        if value is None:
            return cell == ""
        return cell == value if isinstance(value, str) else json.loads(cell) == value

    keys = {k for j in jobs for k in j["params"]}
    differ = {k for k in keys if len({json.dumps(j["params"].get(k)) for j in jobs}) > 1}
    assert differ == {"model"} and {k[7:] for k in got if k.startswith("params.")} == differ
    scalars = [k for k in jobs[0]["summary"] if all(isinstance(j["summary"].get(k), (int, float, str, bool))
                                                     for j in jobs)]
    assert {k[8:] for k in got if k.startswith("summary.")} >= set(scalars) and "num_layers" in scalars
    for key, cells in got.items():
        if key.startswith(("params.", "summary.")):
            part, name = key.split(".", 1)
            assert all(same(cell, j[part].get(name)) for cell, j in zip(cells, jobs)), key

    # a series no job has: exit 1 like `lmscope results`; one of two names missing: a warning, exit 0
    results = lmscope(env, "results", str(a), "--series", "nosuch")
    compared = lmscope(env, "compare", str(a), str(b), "--series", "nosuch")
    assert results.returncode == compared.returncode == 1 and compared.stdout == ""
    assert "'nosuch'" in compared.stderr and "parameters.by_layer" in compared.stderr
    some = lmscope(env, "compare", str(a), str(b), "--series", "nosuch", "--series", "parameters.by_layer",
                   "--format", "csv")
    assert some.returncode == 0 and "'nosuch'" in some.stderr
    assert some.stdout.splitlines()[0] == f"series,group,x_meaning,x,job {a},job {b}"  # a label per column

    # the plot the CLI wrote names the jobs by their model and the curves by their group (an SVG: matplotlib
    # writes each text as a comment beside its glyphs, in drawing order)
    svg = tmp_path / "cmp.svg"
    drawn = lmscope(env, "compare", str(a), str(b), "--series", "parameters.by_layer", "--plot", str(svg))
    assert drawn.returncode == 0, drawn.stderr
    texts = re.findall(r"<!-- (.*?) -->", svg.read_text())
    legend = [f"job {a} (model=tiny-gpt2)", f"job {b} (model=tiny-llama)", "group=attention", "group=mlp",
              "group=norms", "group=total"]
    assert [t for t in texts if t in legend] == legend, texts
    assert "layer" in texts and "parameters [parameters.by_layer]" in texts, texts
    bad = lmscope(env, "compare", str(a), str(b), "--series", "parameters.by_layer", "--plot", str(tmp_path / "c.txt"))
    assert bad.returncode == 2 and "cannot draw a .txt file" in bad.stderr and bad.stdout == ""


def test_progress_off_a_terminal_logs_status_changes_and_a_line_every_30_seconds():
    """`--wait > log`: a train job's ETA changes at every poll (twice a second); the log gets a line when
    the status changes and otherwise one per LOG_EVERY seconds, not one per poll."""
    import io

    from lmscope.cli import ProgressLine

    now = [0.0]
    out = io.StringIO()
    line = ProgressLine(7, stream=out, clock=lambda: now[0])

    def job(status, done, total=100):
        return {"status": status, "progress": {"done": done, "total": total, "fraction": done / total,
                                               "stage": f"train loss 3.2 · ETA {100 - done}s"}}

    line(job("queued", 0))
    for step in range(1, 122):  # 60.5 s of polls every 0.5 s, a new ETA each time
        now[0] = step * 0.5
        line(job("running", min(step, 100)))
    now[0] += 0.5
    line(job("succeeded", 100))
    logged = out.getvalue().splitlines()
    assert [l.split()[2] for l in logged] == ["queued", "running", "running", "running", "succeeded"]
    assert " 1/100" in logged[1] and " 61/100" in logged[2] and " 100/100" in logged[3]  # at 0.5 s, 30.5 s, 60.5 s

    # a cancel request is news at once, not at the next 30 s line
    line(job("running", 1))
    now[0] += 1
    line({**job("running", 2), "cancel_requested": True})
    assert out.getvalue().splitlines()[-1].startswith("job 7 running (cancelling)")


def test_progress_of_a_queued_job_says_what_it_waits_behind():
    import io

    from lmscope.cli import ProgressLine

    line = ProgressLine(7, stream=io.StringIO())
    queued = {"status": "queued", "progress": None, "queue": {"ahead": 2, "running": 1}}
    assert line.render(queued) == "job 7 queued (2 ahead, 1 running)"
    assert line.render({**queued, "status": "running"}) == "job 7 running"  # a stale queue field says nothing
    stopped = {**queued, "queue": {"ahead": 0, "running": 0, "worker_stopped": "the GPU is unusable; restart"}}
    assert line.render(stopped) == "job 7 queued (no worker takes jobs: the GPU is unusable; restart)"
    # with a broker and no Celery worker consuming its queue: the job waits for one, which the line says
    idle = {**queued, "queue": {"ahead": 0, "running": 0, "workers": 0}}
    assert line.render(idle) == ("job 7 queued (no worker takes jobs from the queue: it waits until one starts "
                                 "(`lmscope worker`, docs/operations.md))")
    assert line.render({**queued, "queue": {"ahead": 2, "running": 1, "workers": 1}}) == "job 7 queued (2 ahead, 1 running)"
    # nothing ahead and nothing running: it is next (`0 ahead, 0 running` read as a contradiction)
    assert line.render({**queued, "queue": {"ahead": 0, "running": 0}}) == "job 7 queued (next: a worker takes it in a moment)"
    # submitted while the broker was down: `--wait` says why it does not move (only `show` said it)
    unsent = {**queued, "queue": {"ahead": 0, "running": 0, "unsent": True}}
    assert line.render(unsent) == ("job 7 queued (0 ahead, 0 running; not handed to the broker yet: it is sent when "
                                   "the broker answers)")
    # a sweep submitted then: the sweep runs, its children wait for the broker
    sweep = {"status": "running", "progress": {"done": 0, "total": 3, "fraction": 0.0, "stage": "children"},
             "children_unsent": 1}
    assert line.render(sweep).endswith("0/3 children; 1 child not handed to the broker yet")
    assert "broker" not in line.render(sweep, head=False)
    # re-queued after a lost worker: the progress is its last attempt's, said as such and without a bar
    requeued = {**queued, "attempts": 1, "progress": {"done": 84, "total": 120, "fraction": 0.7, "stage": "train"}}
    assert line.render(requeued) == "job 7 queued (2 ahead, 1 running); its last attempt got to 70.0% (84/120)"
    assert line.render(requeued, head=False) == "its last attempt got to 70.0% (84/120)"  # `show`'s own line


def test_an_api_problem_is_shown_with_each_field_once(capsys):
    """A problem's detail often holds its field's message (the dimension-wise refusal): the sentence is shown
    once, and the field it belongs to still named; a field message the detail lacks is shown whole."""
    from lmscope.cli import ApiFailure
    from lmscope.client import LmscopeError

    said = "model 'f' (falcon) computes its attention in its own modules, so lmscope never sees its q and k"
    problem = {"title": "Dimension-wise entropy cannot read this model", "detail": f"{said}; set dimension_wise=false",
               "errors": [{"loc": ["params", "dimension_wise"], "msg": said},
                          {"loc": ["params", "dataset"], "msg": "dataset 'x' is not registered"}]}
    ApiFailure(LmscopeError(422, problem)).show()
    err = capsys.readouterr().err
    assert err.count(said) == 1 and "(field params.dimension_wise)" in err
    assert "params.dataset: dataset 'x' is not registered" in err


# ---------------------------------------------------------------- messages of a user test

def test_up_says_a_broker_url_is_ignored_and_its_readyz_pings_none(sqlite_url, settings_factory, monkeypatch, capsys):
    """With LMSCOPE_BROKER_URL set, `lmscope up` queued in-process but /readyz said "broker: Connection refused"
    (503) for ever, and the tokens the URL switched on went unexplained."""
    import werkzeug.serving

    from lmscope.up import serve

    ready = []

    class Server:  # serve_forever asks /readyz of the app being served, with its worker running
        port = 18766

        def __init__(self, app):
            self.app = app

        def serve_forever(self):
            r = self.app.test_client().get("/readyz")
            ready.append((r.status_code, r.get_json()))

        def server_close(self):
            pass

    monkeypatch.setattr(werkzeug.serving, "make_server", lambda host, port, app, **k: Server(app))
    from lmscope.config import Settings

    settings = Settings.from_env({"LMSCOPE_DATA_DIR": str(settings_factory().data_dir),
                                  "LMSCOPE_BROKER_URL": "redis://127.0.0.1:1/0"}, database_url=sqlite_url)
    assert settings.auth  # the URL's default, also here
    serve(settings)
    out = capsys.readouterr().out
    assert "lmscope up: LMSCOPE_BROKER_URL is ignored: this process queues and runs its jobs itself" in out
    assert "bearer tokens required (LMSCOPE_AUTH=1, its default while LMSCOPE_BROKER_URL is set)" in out
    assert ready == [(200, {"status": "ready", "checks": {"database": "ok", "worker": "ok"}})]
    serve(settings_factory(database_url=sqlite_url, auth=False))
    out = capsys.readouterr().out
    assert "LMSCOPE_BROKER_URL" not in out and "bearer tokens" not in out


class _Watched:
    """`Client.wait` that reports the job once in `status`, then raises `stop` (Ctrl-C or the timeout)."""

    def __init__(self, status, stop):
        self.status, self.stop = status, stop

    def wait(self, job_id, *, on_progress=None, timeout=None, on_outage=None):
        on_progress({"id": job_id, "status": self.status, "progress": None,
                     "queue": {"ahead": 3, "running": 1} if self.status == "queued" else None})
        raise self.stop


def test_stopping_to_watch_names_the_jobs_real_status(monkeypatch):
    """Ctrl-C or --timeout on a queued job said "job 17 keeps running": it had not started."""
    for status, says, verb in (("queued", "stays queued", "drop"), ("running", "keeps running", "stop")):
        monkeypatch.setattr("lmscope.cli.client", lambda: _Watched(status, KeyboardInterrupt()))
        r = CliRunner().invoke(main, ["wait", "17"])
        assert r.exit_code == 130
        assert f"stopped watching; job 17 {says} (`lmscope cancel 17` to {verb} it)" in r.stderr
        monkeypatch.setattr("lmscope.cli.client",
                            lambda: _Watched(status, TimeoutError(f"job 17 is still {status} after 15.0 s")))
        r = CliRunner().invoke(main, ["wait", "17", "--timeout", "15"])
        assert r.exit_code == 1
        assert f"job 17 is still {status} after 15.0 s; it {says}: `lmscope wait 17`" in r.stderr
        assert ("keeps running" in r.stderr) == (status == "running")


def test_params_files_that_are_empty_or_a_whole_request_say_so(tmp_path):
    """/dev/null "did not exist"; a request body ({"kind", "params"}) gave "unknown field params.kind"."""
    with pytest.raises(click.BadParameter, match="/dev/null is empty; it must hold a JSON object of parameters"):
        build_params((), "/dev/null")
    f = tmp_path / "p.json"
    f.write_text("[1, 2]")
    with pytest.raises(click.BadParameter, match="holds a list, not a JSON object of parameters"):
        build_params((), str(f))
    with pytest.raises(click.BadParameter, match="is a directory"):
        build_params((), str(tmp_path))
    # a whole request of the kind submitted stands for its params; -p still goes on top
    f.write_text(json.dumps({"kind": "norms", "params": {"model": "tiny-gpt2", "max_samples": 5}}))
    assert build_params(("max_samples=9",), str(f), None, "norms") == {"model": "tiny-gpt2", "max_samples": 9}
    with pytest.raises(click.BadParameter, match=r"a whole request for kind 'norms'; --params takes only a params "
                                                 r"object \(its \"params\"\)"):
        build_params((), str(f), None, "probe")
    f.write_text(json.dumps({"kind": "norms", "params": {}, "name": "x", "tags": ["a"]}))
    with pytest.raises(click.BadParameter, match="a whole request with name, tags; .*--name, --tag"):
        build_params((), str(f), None, "norms")


def test_an_lmscope_url_ending_in_v1_is_the_apis_root(monkeypatch):
    """LMSCOPE_URL=http://host:8765/v1 asked for /v1/v1/jobs: "there is nothing at /v1/v1/jobs"."""
    from lmscope.cli import client

    for url in ("http://gpubox:8765/v1", "http://gpubox:8765/v1/", "http://gpubox:8765"):
        monkeypatch.setenv("LMSCOPE_URL", url)
        assert client().url == "http://gpubox:8765"
    monkeypatch.setenv("LMSCOPE_URL", "http://gpubox:8765/lmscope/v10")
    assert client().url == "http://gpubox:8765/lmscope/v10"


def test_user_list_aligns_admins_with_the_others(sqlite_url, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATABASE_URL", sqlite_url)
    runner = CliRunner()
    for args in (["ann", "--admin"], ["bobby"]):
        assert runner.invoke(main, ["user", "create", *args]).exit_code == 0
    lines = runner.invoke(main, ["user", "list"]).stdout.splitlines()
    assert lines[0].startswith("ann  (admin)") and lines[1].startswith("bobby")
    assert len({line.index("max_active_jobs=") for line in lines}) == 1, lines


def test_a_sweeps_final_report_counts_its_children_once(capsys):
    from lmscope.cli import report_final

    class Api:
        url, token = "http://x", None

        def artifacts(self, job_id):
            return []

    counts = {"total": 6, "queued": 0, "running": 0, "succeeded": 6, "failed": 0, "cancelled": 0}
    report_final(Api(), {"id": 4, "kind": "sweep", "status": "succeeded", "children": counts,
                         "summary": {"children": {"succeeded": 6}, "best_loss": 0.25}})
    out = capsys.readouterr().out
    assert out.count("children") == 1 and "children: 6 succeeded" in out and "best_loss: 0.25" in out


def test_a_list_written_without_quotes_gets_its_json_spelling():
    """`-p 'models=[a,b]'` said only "does not parse ... a list is written [1, 2]"."""
    entropy = KINDS["entropy"].params.model_json_schema()
    sweep = KINDS["sweep"].params.model_json_schema()
    with pytest.raises(click.BadParameter, match=r"models=\[a,b\] is not JSON: strings in a list need double "
                                                 r"quotes: \[\"a\", \"b\"\]$"):
        parse_param("[a,b]", entropy, "models")
    with pytest.raises(click.BadParameter, match=r"quotes: \[\"gpt2\", \"llama\"\]$"):
        parse_param("['gpt2', llama]", entropy, "models")
    with pytest.raises(click.BadParameter, match=r"a list is written \[\"a\", \"b\"\]"):
        parse_param("[a,b", entropy, "models")
    # a list of numbers: no quotes to suggest, and its example has numbers
    with pytest.raises(click.BadParameter, match=r"starts like JSON but does not parse: .*a list is written \[1, 2\]"):
        parse_param("[a,2]", sweep, "grid.latent_dim")


@pytest.fixture
def live_app(sqlite_url, settings_factory, tmp_path):
    """The API on a real port, tokens off (the admin `local`), a publisher that only records."""
    from lmscope.api import create_app
    from tests.api.conftest import LiveServer, RecordingPublisher

    app = create_app(settings_factory(database_url=sqlite_url, auth=False), publisher=RecordingPublisher())
    server = LiveServer(app)
    yield app, CliRunner(env={"LMSCOPE_URL": server.url, "LMSCOPE_TOKEN": None})
    server.stop()


def test_a_list_field_given_a_comma_list_or_a_number_is_told_the_list_it_meant(live_app):
    """`-p models=a,b` got "a list of one is written ["x"]"; `grid.latent_dim=4` an example of strings."""
    _, runner = live_app
    r = runner.invoke(main, ["submit", "entropy", "-p", "models=gpt2,llama", "-p", "dataset=d"])
    assert r.exit_code == 1 and 'got the string "gpt2,llama" (write ["gpt2", "llama"])' in r.stderr, r.output
    r = runner.invoke(main, ["submit", "sweep", "-p", "study=sumformer", "-p", "grid.latent_dim=4"])
    assert r.exit_code == 1, r.output
    assert "expected a list, e.g. [1, 2]; got the integer 4 (a list of one is written [4])" in r.stderr
    r = runner.invoke(main, ["submit", "sweep", "-p", "study=sumformer", "-p", "grid.latent_dim=2,4"])
    assert "(write [2, 4])" in r.stderr and '"' not in r.stderr.split("(write")[1], r.stderr


def test_deleting_an_active_runs_checkpoints_names_its_train_job(live_app):
    """A run still training was told "again once they are free", not which job holds them or how to stop it."""
    from sqlalchemy import update

    from lmscope.db.models import Dataset, Job, Model

    app, runner = live_app
    sessions = app.extensions["lmscope"].sessions
    with sessions.begin() as session:
        session.add(Dataset(name="d", source="upload", path="/nonexistent", format="text", num_documents=1,
                            num_bytes=1, sha256="0" * 64))
    r = runner.invoke(main, ["submit", "train", "-p", "dataset=d", "-p", "run_name=blip"])
    assert r.exit_code == 0, r.output
    run = int(r.stdout.strip())
    with sessions.begin() as session:
        session.add(Model(name="blip@step0", source="checkpoint", num_layers=2, job_id=run, step=0))
    for status in ("queued", "running"):
        with sessions.begin() as session:
            session.execute(update(Job).where(Job.id == run).values(status=status))
        r = runner.invoke(main, ["models", "delete", "--run", "blip"])
        assert r.exit_code == 1
        assert (f"run 'blip' has not ended (train job {run} is {status}): `lmscope cancel {run}` first, or wait for "
                "it to end; then `lmscope models delete --run blip` again") in r.stderr
        assert "once they are free" not in r.stderr


def test_the_models_list_shows_grouped_query_heads(monkeypatch):
    """Grouped-query attention showed only in /v1/models' JSON: the list has a KV column beside HEADS."""
    api = _FakeApi(models=[{"name": "q", "source": "directory", "architecture": "Qwen2ForCausalLM", "layers": 4,
                            "heads": 4, "kv_heads": 2, "hidden": 64, "context": 256, "params": 1000}])
    monkeypatch.setattr("lmscope.cli.client", lambda: api)
    header, row = CliRunner().invoke(main, ["models"]).stdout.splitlines()
    assert header.split()[3:7] == ["LAYERS", "HEADS", "KV", "HIDDEN"] and row.split()[3:7] == ["4", "4", "2", "64"]


@pytest.mark.parametrize("job, subject", [
    ({"kind": "norms", "params": {"model": "gpt2", "dataset": "wikitext-2"}}, "gpt2 · wikitext-2"),
    ({"kind": "entropy", "params": {"models": [f"r@step{s}" for s in (0, 100, 200)], "dataset": "w"}},
     "r@step0 … r@step200 (3 models) · w"),
    ({"kind": "entropy", "params": {"models": ["a", "b"], "dataset": "w"}}, "a, b · w"),
    ({"kind": "entropy", "params": {"train_job": 2, "dataset": "w"}}, "train job 2 · w"),
    ({"kind": "sweep", "params": {"target": ["fig2_poly", "max_dist"]}}, "sumformer study · fig2_poly, max_dist"),
    ({"kind": "sweep", "params": {"study": "attention", "model": "m", "dataset": "w"}}, "attention study · m · w"),
    ({"kind": "sumformer_fit", "params": {"architecture": "mlp_sumformer", "target": "sin_exp"}},
     "mlp_sumformer · sin_exp"),
    ({"kind": "attention_approx", "params": {"method": "performer", "model": "m", "dataset": "w"}}, "performer · m · w"),
    ({"kind": "probe", "params": {}}, ""),
])
def test_the_jobs_list_says_what_each_job_ran_on(job, subject):
    """The ON column, as the dashboard's list says it: with several models a list was hard to read."""
    from lmscope.cli import job_subject

    assert job_subject(job) == subject
