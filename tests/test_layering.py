"""The dependency direction of DESIGN.md §1 is a rule: checked with import-linter's contracts."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import need_module

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    need_module("importlinter")
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    result = subprocess.run([sys.executable, "-c", code, "--config", str(ROOT / "pyproject.toml")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_api_serves_without_torch(tmp_path):
    """The API image has no torch (nor matplotlib): an app made and asked for its pages must not pull them in.
    The blueprints are imported inside create_app, so importing lmscope.api alone would not load them."""
    code = ("import sys; from lmscope.api import create_app; from lmscope.config import Settings; "
            "from lmscope.db.engine import upgrade; from lmscope.queue import LocalPublisher; "
            "settings = Settings.from_env({'LMSCOPE_DATA_DIR': sys.argv[1], 'LMSCOPE_AUTH': '0'}); "
            "upgrade(settings.database_url); client = create_app(settings, publisher=LocalPublisher()).test_client(); "
            "codes = [client.get(p).status_code for p in ('/', '/docs', '/openapi.json', '/v1/kinds', '/v1/jobs')]; "
            "assert codes == [200] * 5, codes; "
            "heavy = [m for m in ('torch', 'transformers', 'triton', 'numpy', 'matplotlib') if m in sys.modules]; "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
