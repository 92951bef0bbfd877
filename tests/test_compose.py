"""docker-compose.yml and the Dockerfiles agree with the code (no Docker needed to check that)."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from lmscope.cli import main
from lmscope.config import ENV_VARS, Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with nothing set in the environment → the default."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


def env_of(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(str(v)) for k, v in env.items()}


def mounts_of(service: str) -> dict[str, str]:
    """container path → source (named volume or host path)."""
    return {interpolate(v).split(":")[1]: interpolate(v).split(":")[0] for v in SERVICES[service].get("volumes", [])}


def test_services_and_healthchecks():
    assert {"redis", "db", "migrate", "api", "worker"} <= set(SERVICES)
    assert SERVICES["redis"]["image"].startswith("redis:7")
    assert SERVICES["db"]["image"].startswith("postgres:16")
    redis_cmd = " ".join(SERVICES["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd
    assert "redis-cli" in " ".join(SERVICES["redis"]["healthcheck"]["test"])
    assert "pg_isready" in " ".join(SERVICES["db"]["healthcheck"]["test"])
    assert "/readyz" in " ".join(SERVICES["api"]["healthcheck"]["test"])
    assert SERVICES["migrate"]["depends_on"]["db"]["condition"] == "service_healthy"
    for name in ("api", "worker"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert SERVICES["migrate"].get("restart") == "no"  # one-shot
    declared = set(COMPOSE.get("volumes") or {})
    for service in SERVICES.values():
        for source in [interpolate(v).split(":")[0] for v in service.get("volumes", [])]:
            assert source.startswith((".", "/")) or source in declared, source


def test_every_lmscope_variable_is_known_and_read_by_settings():
    from_env = inspect.getsource(Settings.from_env)
    for service in SERVICES:
        for name, value in env_of(service).items():
            if not name.startswith("LMSCOPE_"):
                continue
            assert name in ENV_VARS, f"{service} sets {name}, which lmscope.config.ENV_VARS does not document"
            assert f'"{name}"' in from_env, f"{service} sets {name}, which Settings.from_env never reads"
    settings = Settings.from_env(env_of("api"))
    assert settings.database_url.startswith("postgresql+psycopg://") and "@db:5432/" in settings.database_url
    assert settings.broker_url == "redis://redis:6379/0" and settings.auth
    assert settings.data_dir == Path("/data") and settings.artifact_dir == Path("/data/artifacts")
    assert settings.model_dirs == [Path("/models")]
    assert env_of("api") == env_of("worker") == env_of("migrate")  # one configuration for every process


def test_api_and_workers_share_data_artifacts_and_models():
    settings = Settings.from_env(env_of("api"))
    api, worker = mounts_of("api"), mounts_of("worker")
    for path in (settings.data_dir, settings.artifact_dir, *settings.model_dirs, settings.wikitext2_path.parent.parent):
        # The mount that holds `path` in each container, and it is the same volume in both.
        holder = lambda mounts: max((m for m in mounts if path.is_relative_to(m)), key=len, default=None)  # noqa: E731
        assert holder(api) and holder(api) == holder(worker), path
        assert api[holder(api)] == worker[holder(worker)], path
    assert api[str(settings.data_dir)] in COMPOSE["volumes"]  # a named volume, not a container-local path


def test_commands_exist():
    scripts = PYPROJECT["project"]["scripts"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name in ("migrate", "api", "worker"):
        argv = SERVICES[name]["command"]
        if argv[0] == "gunicorn":
            assert any(dep.startswith("gunicorn") for dep in extras["api"])
            target = argv[-1]
            assert target == "lmscope.api.wsgi:app"
            continue
        assert scripts[argv[0]] == "lmscope.cli:main"
        group, words = main, [a for a in argv[1:] if not a.startswith("-")]
        for word in words:
            if not hasattr(group, "commands"):
                break
            assert word in group.commands, f"`{' '.join(argv)}`: no subcommand {word!r}"
            group = group.commands[word]
        for option in [a.split("=")[0] for a in argv[1:] if a.startswith("--")]:
            assert any(option in p.opts for p in group.params), f"`{' '.join(argv)}`: no option {option}"


def test_gunicorn_target_imports_without_torch(tmp_path):
    """What the API image runs: `lmscope.api.wsgi:app` is a Flask app, and nothing heavy is imported."""
    code = ("import sys; from lmscope.api.wsgi import app; assert app.name == 'lmscope.api'; "
            "heavy = [m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSCOPE_")}
    env["LMSCOPE_DATA_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(ROOT)
    env["LMSCOPE_BROKER_URL"] = "redis://127.0.0.1:9/0"  # never contacted at import
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Without a broker its jobs would never run (and tokens would be off): it refuses to start.
    del env["LMSCOPE_BROKER_URL"]
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "needs LMSCOPE_BROKER_URL" in result.stderr


def test_dockerfiles():
    api = (ROOT / "docker" / "api.Dockerfile").read_text()
    worker = (ROOT / "docker" / "worker.Dockerfile").read_text()
    for name in ("api", "migrate"):
        assert SERVICES[name]["build"]["dockerfile"] == "docker/api.Dockerfile"
    assert SERVICES["worker"]["build"]["dockerfile"] == "docker/worker.Dockerfile"
    assert re.search(r'pip install "\.\[api\]"', api) and "torch" not in api.replace("no torch", "")
    assert re.search(r"FROM python:3\.\d+-slim", api)
    # `docker run lmscope-api` serves the way the compose api service does.
    cmd = re.search(r"^CMD (\[.*?\])\s*$", api.replace("\\\n", " "), re.M | re.S)
    assert cmd and json.loads(cmd.group(1)) == SERVICES["api"]["command"]
    assert re.search(r'pip install "\.\[worker[^"]*\]"', worker)
    assert re.search(r"ARG BASE_IMAGE=pytorch/pytorch:[\w.-]*cuda[\w.-]*runtime", worker)


def gpus_of(service: dict) -> list[str]:
    """The GPU ids a service reserves; fails unless it pins exactly one NVIDIA GPU by id."""
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1, devices
    (gpu,) = devices
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    # By id, not `count: 1`: a count hands every worker the same first GPU.
    assert "count" not in gpu and len(gpu["device_ids"]) == 1, gpu
    return gpu["device_ids"]


def test_one_worker_per_gpu_and_the_documented_recipe_for_more():
    """The worker reserves one GPU; the header's recipe for the next GPU (pasted under `services:`)
    gives an identical worker pinned to another GPU, and nothing else."""
    assert gpus_of(SERVICES["worker"]) == ["0"]
    assert SERVICES["worker"].get("hostname") is None  # the claim tells dead local job processes by host name
    text = (ROOT / "docker-compose.yml").read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   worker-gpu1:"))
    recipe = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        recipe.append("  " + line[4:])
    extended = yaml.safe_load(text.replace("\nservices:\n", "\nservices:\n" + "\n".join(recipe) + "\n", 1))
    services = extended["services"]
    assert set(services) == set(SERVICES) | {"worker-gpu1"}
    assert gpus_of(services["worker-gpu1"]) == ["1"] and gpus_of(services["worker"]) == ["0"]
    for key in ("image", "build", "command", "environment", "volumes", "depends_on", "stop_grace_period"):
        assert services["worker-gpu1"][key] == SERVICES["worker"][key], key
