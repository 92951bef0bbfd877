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


# ---------------------------------------------------------------- parameter tables

_MISSING = object()


def _documented_default(text: str):
    """A table's default cell as a value: 5000, 1e-3, true, null, "last", [1, 2, …, 10] → (first, last)."""
    text = text.strip().strip("`").strip()
    if text in ("—", "(required)", "required"):
        return _MISSING
    if text.startswith("["):
        items = [item.strip() for item in text.strip("[]").split(",")]
        values = [_documented_default(i) for i in items if i != "…"]
        return ("ends", values[0], values[-1]) if "…" in items else values
    if text in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[text]
    try:
        return int(text) if text.lstrip("-").isdigit() else float(text)
    except ValueError:
        return text.strip('"')


def _parameter_tables(doc: Path):
    """Rows of the doc's `| name/parameter | default | meaning |` tables: [(names, default cells)]."""
    tables, rows = [], None
    for line in doc.read_text().splitlines():
        if line.startswith(("| name | default |", "| parameter | default |")):
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("| `"):
            names_cell, default_cell = line.split(" | ")[:2]
            names = [n.strip(" |`") for n in names_cell.split(",")]
            defaults = [default_cell] if len(names) == 1 else default_cell.split(", ")
            rows.append((names, defaults))
        elif rows is not None and not line.startswith("|"):
            rows = None
    return tables


def _field_default(model, dotted: str):
    for part in dotted.split(".")[:-1]:
        model = model.model_fields[part].annotation
    field = model.model_fields[dotted.split(".")[-1]]
    return _MISSING if field.is_required() else field.get_default(call_default_factory=True)


def test_parameter_tables_in_the_docs_give_the_models_defaults():
    """Every default a doc's parameter table states is the pydantic model's (the one definition)."""
    from lmscope.params import KINDS

    docs = {"docs/analyses/norms.md": ["norms"], "docs/analyses/entropy.md": ["entropy"],
            "docs/analyses/sweep.md": ["sweep", "sweep"],
            "docs/analyses/pruning.md": ["pruning"], "docs/analyses/operator.md": ["operator"], "docs/models-and-datasets.md": ["probe", "train"]}
    checked = 0
    for doc, kinds in docs.items():
        tables = _parameter_tables(ROOT / doc)
        assert len(tables) == len(kinds), f"{doc}: expected {len(kinds)} parameter tables, found {len(tables)}"
        for kind, rows in zip(kinds, tables):
            model = KINDS[kind].params
            for names, cells in rows:
                if len(names) != len(cells):  # "`model` / `models` / `train_job`": one cell for several
                    continue
                for name, cell in zip(names, cells):
                    if name not in model.model_fields and "." not in name:
                        continue  # a row that is not one field, e.g. "`model` / `models`"
                    said, actual = _documented_default(cell), _field_default(model, name)
                    if isinstance(said, tuple):  # [first, …, last]
                        assert [actual[0], actual[-1]] == list(said[1:]), (doc, name, cell, actual)
                    elif said is _MISSING or actual is _MISSING:
                        assert said is actual or name == "study", (doc, name, cell, actual)
                    elif (isinstance(said, str) and not isinstance(actual, str)) or (actual is None and said is not None):
                        continue  # a default computed at run time: prose ("= heads") or its usual value (seq_len 512)
                    else:
                        assert said == actual, (doc, name, cell, actual)
                    checked += 1
    assert checked >= 60, checked  # the tables were found and read


def test_the_sweep_docs_python_block_runs_a_sweep_without_the_service(tmp_path, monkeypatch):
    """docs/analyses/sweep.md's 'Python use' block, as written: every grid point, then the parent's
    aggregation, which draws the figures and picks d' by the lowest validation error (checked here on the
    children's own errors)."""
    text = (ROOT / "docs/analyses/sweep.md").read_text()
    section = text[text.index("## Python use (without the service)"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```", start)]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "sweep.md", "exec"), scope)
    (best,) = scope["parent"].summary["best"]
    errors = {r.params["latent_dim"]: r.summary["best_val_error"] for r in scope["results"]}  # one seed each
    assert best["best_latent_dim"] == min(errors, key=errors.get)
    assert best["best_val_error"] == min(errors.values())
    assert (tmp_path / "out/sweep/fig2_latent_dim.png").stat().st_size > 10_000
