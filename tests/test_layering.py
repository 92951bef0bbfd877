"""The dependency direction of DESIGN.md §1 is a rule: checked with import-linter's contracts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    result = subprocess.run([sys.executable, "-c", code, "--config", str(ROOT / "pyproject.toml")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_api_imports_without_torch():
    """The API image has no torch: importing the app factory must not pull it in."""
    code = ("import sys; import lmscope.api, lmscope.params, lmscope.catalog, lmscope.queue; "
            "heavy = [m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
