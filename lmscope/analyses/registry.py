"""Which function runs each job kind. Imported lazily so that a worker pays only for what it runs."""

from __future__ import annotations

import importlib
from typing import Callable

RUNNERS: dict[str, str] = {
    "probe": "lmscope.analyses.probe:run",
    "train": "lmscope.analyses.train:run",
    "norms": "lmscope.analyses.norms:run",
    "entropy": "lmscope.analyses.entropy:run",
    "pruning": "lmscope.analyses.pruning:run",
    "operator": "lmscope.analyses.operator:run",
    "sumformer_fit": "lmscope.analyses.sumformer_fit:run_sumformer_fit",
    "attention_approx": "lmscope.analyses.attention_approx:run_attention_approx",
}

# Parent kinds: called once, when the last child has finished.
AGGREGATORS: dict[str, str] = {
    "sweep": "lmscope.analyses.sweep:aggregate",
}


def _load(ref: str) -> Callable:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def runner_for(kind: str) -> Callable:
    """``run(params, ctx) -> JobOutput`` for a kind."""
    return _load(RUNNERS[kind])


def aggregator_for(kind: str) -> Callable:
    """``aggregate(params, children: list[ChildResult], ctx) -> JobOutput`` for a parent kind."""
    return _load(AGGREGATORS[kind])
