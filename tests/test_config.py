"""Settings from the environment."""

import os
from pathlib import Path

from lmscope.config import Settings


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
