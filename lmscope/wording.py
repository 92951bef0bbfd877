"""How lmscope's messages name things, shared by the API's problems and the CLI (no dependencies)."""

from __future__ import annotations

import difflib

# What to do about a model whose attention lmscope's attention functions never see
STUDY_INTERFACE_MODEL = ("study a model whose attention goes through transformers' AttentionInterface "
                         "(docs/models-and-datasets.md lists them)")


def did_you_mean(word: str, names, cutoff: float = 0.6) -> str:
    """"; did you mean 'max_samples'?" for the closest of `names` to a misspelt `word`, or ""."""
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


def error_line(e: BaseException) -> str:
    """"OperationalError: connection refused": an exception's type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0]}"


def byte_size(n: int) -> str:
    """'64.0 MiB', '1.0 GiB': a size as a person reads it (binary units, as the limits are documented)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def article(word: str) -> str:
    """'an' before 'entropy', 'a' before 'norms'."""
    return "an" if word[:1].lower() in "aeiou" else "a"
