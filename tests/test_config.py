"""Settings from the environment."""

import os
from pathlib import Path

import pytest

from lmscope.config import ConfigError, Settings


def test_relative_directories_become_absolute(tmp_path, monkeypatch):
    """`LMSCOPE_DATA_DIR=.demo` must mean the same folder to every part (send_file resolves relative
    paths against the Flask package, not the working directory)."""
    monkeypatch.chdir(tmp_path)
    s = Settings.from_env({"LMSCOPE_DATA_DIR": ".demo", "LMSCOPE_MODEL_DIRS": os.pathsep.join(["models", "/abs"])})
    assert s.data_dir == tmp_path / ".demo"
    assert s.artifact_dir == tmp_path / ".demo" / "artifacts"
    assert s.database_url == f"sqlite:///{tmp_path / '.demo' / 'lmscope.db'}"
    assert s.model_dirs == [tmp_path / "models", Path("/abs")]


def test_embedded_mode_defaults_to_no_tokens_and_a_broker_turns_them_on():
    assert Settings.from_env({}).auth is False and Settings.from_env({}).embedded
    team = Settings.from_env({"LMSCOPE_BROKER_URL": "redis://redis:6379/0"})
    assert team.auth is True and not team.embedded


def test_on_off_words_any_case_and_anything_else_is_refused_by_name():
    for word, on in [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                     ("0", False), ("False", False), ("no", False), ("OFF", False)]:
        assert Settings.from_env({"LMSCOPE_AUTH": word}).auth is on, word
    # an explicit word wins over the broker's default either way
    assert Settings.from_env({"LMSCOPE_AUTH": "off", "LMSCOPE_BROKER_URL": "redis://r:6379/0"}).auth is False
    with pytest.raises(ConfigError, match=r"LMSCOPE_AUTH='disabled' is neither on nor off; write LMSCOPE_AUTH=1"):
        Settings.from_env({"LMSCOPE_AUTH": "disabled"})


def test_an_empty_variable_is_an_unset_one(tmp_path, monkeypatch):
    """`LMSCOPE_DATA_DIR=` must not mean the working directory, nor `LMSCOPE_DATABASE_URL=` an unparsable URL."""
    monkeypatch.setenv("HOME", str(tmp_path))
    empty = Settings.from_env({name: "" for name in ("LMSCOPE_DATA_DIR", "LMSCOPE_DATABASE_URL", "LMSCOPE_ARTIFACT_DIR",
                                                     "LMSCOPE_MAX_ACTIVE_JOBS", "LMSCOPE_PORT")})
    assert empty == Settings.from_env({})
    assert empty.data_dir == tmp_path / ".lmscope" and empty.database_url.startswith("sqlite:///")
    # and an empty LMSCOPE_AUTH leaves the default: tokens on where there is a broker
    assert Settings.from_env({"LMSCOPE_AUTH": " ", "LMSCOPE_BROKER_URL": "redis://r:6379/0"}).auth is True


def test_a_malformed_number_names_its_variable_and_the_default():
    with pytest.raises(ConfigError, match=r"LMSCOPE_MAX_ACTIVE_JOBS='20 jobs' is not a whole number; "
                                          r"write e.g. LMSCOPE_MAX_ACTIVE_JOBS=20"):
        Settings.from_env({"LMSCOPE_MAX_ACTIVE_JOBS": "20 jobs"})
    with pytest.raises(ConfigError, match="LMSCOPE_HEARTBEAT_SECONDS='5s' is not a number"):
        Settings.from_env({"LMSCOPE_HEARTBEAT_SECONDS": "5s"})
    assert Settings.from_env({"LMSCOPE_HEARTBEAT_SECONDS": "2.5"}).heartbeat_seconds == 2.5
    # a number that parses but means nothing: no heartbeat every -5 s, no stale-after of nan
    for name, raw in (("LMSCOPE_HEARTBEAT_SECONDS", "-5"), ("LMSCOPE_STALE_AFTER_SECONDS", "nan"),
                      ("LMSCOPE_STALE_AFTER_SECONDS", "inf"), ("LMSCOPE_MAX_ATTEMPTS", "0")):
        with pytest.raises(ConfigError, match=rf"{name}='{raw}' must be a (whole )?number above 0; write e.g. {name}="):
            Settings.from_env({name: raw})


def test_a_stale_limit_shorter_than_four_heartbeats_is_refused():
    """A heartbeat every 30 s against a stale limit of 10 s: the reaper took every running job for lost and failed
    it as worker-lost after three attempts, while its worker was alive."""
    with pytest.raises(ConfigError, match=r"LMSCOPE_STALE_AFTER_SECONDS=10 is less than 4 heartbeats "
                                          r"\(LMSCOPE_HEARTBEAT_SECONDS=30\).*write e.g. LMSCOPE_STALE_AFTER_SECONDS=120"):
        Settings.from_env({"LMSCOPE_HEARTBEAT_SECONDS": "30", "LMSCOPE_STALE_AFTER_SECONDS": "10"})
    with pytest.raises(ConfigError, match="LMSCOPE_STALE_AFTER_SECONDS=60 is less than 4 heartbeats"):
        Settings.from_env({"LMSCOPE_HEARTBEAT_SECONDS": "20"})  # against the default limit
    assert Settings.from_env({"LMSCOPE_HEARTBEAT_SECONDS": "15"}).stale_after_seconds == 60  # exactly 4: fine


def test_autotune_is_on_or_off_and_anything_else_is_refused(monkeypatch):
    from lmscope.kernels.dispatch import autotuning  # needs no triton

    for raw, on in (("", True), ("1", True), ("On", True), ("0", False), (" off ", False), ("no", False)):
        monkeypatch.setenv("LMSCOPE_AUTOTUNE", raw)
        assert autotuning() is on
    monkeypatch.setenv("LMSCOPE_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="LMSCOPE_AUTOTUNE='maybe' is neither on nor off"):
        autotuning()


def test_a_worker_device_or_kernel_backend_it_cannot_use_stops_the_command_by_name(monkeypatch):
    """LMSCOPE_DEVICE=gpu and LMSCOPE_KERNEL_BACKEND=trtion once let `lmscope up` start, then failed every job
    with torch's message or a ValueError that the job page files under bugs."""
    from lmscope.kernels.dispatch import forced_backend
    from lmscope.worker.environment import _device_for_pid

    for raw in ("cpu", "CUDA", "cuda:1", " cuda:0 ", "cuda:10", "mps", "xpu:1"):  # what torch.device takes
        assert Settings.from_env({"LMSCOPE_DEVICE": raw})
    for raw in ("gpu", "cuda:", "cuda:x", "cuda0", "cuda:01", "cpu:0", "tpu"):
        with pytest.raises(ConfigError, match=rf"LMSCOPE_DEVICE='{raw}' is not a device lmscope runs on; write "
                                              r"LMSCOPE_DEVICE=cpu, LMSCOPE_DEVICE=cuda or LMSCOPE_DEVICE=cuda:N"):
            Settings.from_env({"LMSCOPE_DEVICE": raw})
    for raw in ("triton", "Reference"):
        assert Settings.from_env({"LMSCOPE_KERNEL_BACKEND": raw})
    with pytest.raises(ConfigError, match=r"LMSCOPE_KERNEL_BACKEND='trtion' is not a kernel backend; write "
                                          r"LMSCOPE_KERNEL_BACKEND=triton or reference"):
        Settings.from_env({"LMSCOPE_KERNEL_BACKEND": "trtion"})
    # the worker reads them at each job through the same checks (a test may set them after start-up)
    monkeypatch.setenv("LMSCOPE_KERNEL_BACKEND", " TRITON ")
    assert forced_backend() == "triton"
    monkeypatch.setenv("LMSCOPE_KERNEL_BACKEND", "trtion")
    with pytest.raises(ConfigError, match="LMSCOPE_KERNEL_BACKEND='trtion'"):
        forced_backend()
    monkeypatch.setenv("LMSCOPE_DEVICE", "Cuda:1")
    assert _device_for_pid(-1) == "cuda:1"
    _device_for_pid.cache_clear()


def test_the_cli_shows_a_malformed_variable_as_an_error_not_a_traceback(tmp_path):
    from click.testing import CliRunner

    from lmscope.cli import main

    result = CliRunner().invoke(main, ["db", "upgrade"],
                                env={"LMSCOPE_DATA_DIR": str(tmp_path), "LMSCOPE_AUTH": "maybe"})
    assert result.exit_code == 1
    assert "Error: LMSCOPE_AUTH='maybe' is neither on nor off" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "lmscope.db").exists()
    result = CliRunner().invoke(main, ["db", "upgrade"], env={"LMSCOPE_DATA_DIR": str(tmp_path), "LMSCOPE_DEVICE": "gpu"})
    assert result.exit_code == 1 and "Error: LMSCOPE_DEVICE='gpu' is not a device" in result.output


def test_each_documented_numeric_default_is_the_default():
    """The defaults ENV_VARS (and so the README's table) states, "(default 3)", are what an unset variable gives:
    the field a variable sets is found by setting it, then its default compared with the words."""
    import dataclasses
    import re

    from lmscope.config import ENV_VARS

    unset = Settings.from_env({})
    checked = {}
    for name, meaning in ENV_VARS.items():
        stated = re.search(r"\(default (\d+)( MiB)?[;)]", meaning)
        if not stated:
            continue
        other = "70" if name == "LMSCOPE_STALE_AFTER_SECONDS" else "7"  # 7 s is less than 4 default heartbeats
        changed = [f.name for f in dataclasses.fields(Settings)
                   if getattr(Settings.from_env({name: other}), f.name) != getattr(unset, f.name)]
        assert len(changed) == 1, (name, changed)
        default = int(stated.group(1)) * (1024 * 1024 if stated.group(2) else 1)
        checked[name] = getattr(unset, changed[0])
        assert checked[name] == default, (name, meaning)
    assert {"LMSCOPE_MAX_ATTEMPTS", "LMSCOPE_TASK_TIME_LIMIT", "LMSCOPE_PORT", "LMSCOPE_MAX_UPLOAD_BYTES"} <= set(checked)


def test_a_variable_lmscope_does_not_read_is_named_with_the_setting_it_looks_like(tmp_path, monkeypatch):
    """LMSCOPE_HOME, LMSCOPE_DATADIR: a researcher's guess at a name would be ignored without a word, and the data
    go to ~/.lmscope. Every command says so on stderr (and still runs); a documented name is never named."""
    from click.testing import CliRunner

    from lmscope.cli import main
    from lmscope.config import ENV_VARS, unknown_variables

    for name in [*os.environ]:
        if name.startswith("LMSCOPE_"):
            monkeypatch.delenv(name)
    env = {"LMSCOPE_DATADIR": str(tmp_path / "x"), "LMSCOPE_HOME": "/somewhere", "LMSCOPE_DATA_DIR": str(tmp_path),
           "LMSCOPE_TEST_POSTGRES_URL": "postgresql://tests", "NOT_OURS": "1"}
    assert unknown_variables(env) == [
        "LMSCOPE_DATADIR is not a setting lmscope reads, so it is ignored (did you mean LMSCOPE_DATA_DIR? "
        "README.md's Configuration lists them)",
        "LMSCOPE_HOME is not a setting lmscope reads, so it is ignored (README.md's Configuration lists them)"]
    assert unknown_variables({name: "1" for name in ENV_VARS}) == []
    assert "did you mean LMSCOPE_URL?" in unknown_variables({"LMSCOPE_url": "x"})[0]  # only the case differs
    result = CliRunner().invoke(main, ["db", "upgrade"], env=env)
    assert result.exit_code == 0 and (tmp_path / "lmscope.db").exists()  # the command ran
    assert result.stderr.count("is not a setting lmscope reads") == 2 and "LMSCOPE_HOME" in result.stderr
