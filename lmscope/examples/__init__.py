"""Example job parameters, one JSON file each: `lmscope submit KIND --params example:NAME`; the demo runs some."""

from __future__ import annotations

from importlib import resources


def names() -> list[str]:
    """The bundled examples, by file name without .json."""
    return sorted(f.name[:-5] for f in resources.files(__name__).iterdir() if f.name.endswith(".json"))


def read_bytes(name: str) -> bytes:
    """The file of example ``name`` (with or without .json); KeyError for one that is not bundled."""
    name = name.removesuffix(".json")
    if name not in names():
        raise KeyError(name)
    return resources.files(__name__).joinpath(f"{name}.json").read_bytes()
