"""The README documents every setting the code reads and the two set-up commands."""

from pathlib import Path

from lmscope.config import ENV_VARS

ROOT = Path(__file__).resolve().parent.parent


def test_readme_documents_every_environment_variable():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in ENV_VARS if f"`{name}`" not in readme]
    assert not missing, f"README.md's configuration table lacks {missing}"
    # and says what the code says (config.ENV_VARS is the one text; copy it when it changes)
    stale = [name for name, text in ENV_VARS.items() if f"| `{name}` | {text} |" not in readme]
    assert not stale, f"README.md's rows for {stale} differ from lmscope.config.ENV_VARS"


def test_makefile_has_the_two_setup_commands_the_readme_promises():
    makefile = (ROOT / "Makefile").read_text()
    readme = (ROOT / "README.md").read_text()
    for target in ("demo", "test"):
        assert f"\n{target}:" in makefile
        assert f"make {target}" in readme
