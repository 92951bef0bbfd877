"""JSON as RFC 8259 defines it, and no more: how request bodies, model configs and `-p` values are read.

Python's `json` also takes NaN, Infinity and -Infinity, reads 1e400 as inf, keeps the last of two
equal keys without a word and fails with a RecursionError on deep nesting. A value like that, once
stored, makes every later answer invalid JSON (the dashboard's JSON.parse refuses it) or means
something the sender did not see, so each is refused here with a message saying what to change.
Standard library only: the CLI, the catalog and the API all use it.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Containers inside containers; the deepest real documents (a sweep's body, a HF config) nest about 5.
MAX_DEPTH = 32


class StrictJsonError(ValueError):
    """Not strict JSON; the message says what is wrong and where."""


class NonFiniteNumber(StrictJsonError):
    """NaN, Infinity, -Infinity, or a number too large for a double."""


def _refuse_constant(name: str):
    raise NonFiniteNumber(f"{name} is not a JSON number; give a finite number (or null)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"the number {text} is too large (JSON numbers here must fit a double)")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise StrictJsonError(f"the key {twice!r} appears twice in one object; give it once")
    return obj


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse `text` (bytes must be UTF-8); raises StrictJsonError (NonFiniteNumber for NaN and friends).

    Integers may be of any size (up to Python's 4300 digits): a float parameter refuses one that is
    not finite as a float (lmscope.params).
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise StrictJsonError(f"it is not UTF-8: byte {e.start} is {bytes(text[e.start:e.start + 1])!r}") from None
    if not text.strip():
        raise StrictJsonError("it is empty")
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                           object_pairs_hook=_unique_keys)
    except StrictJsonError:
        raise
    except json.JSONDecodeError as e:
        raise StrictJsonError(f"{e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise StrictJsonError(f"it nests arrays and objects more than {max_depth} deep") from None
    except ValueError:  # Python refuses integers of more than 4300 digits
        raise StrictJsonError("a number has too many digits") from None
    if _deeper_than(value, max_depth):
        raise StrictJsonError(f"it nests arrays and objects more than {max_depth} deep")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep (iterative: the value may be ~1000 deep)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
