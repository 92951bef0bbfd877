"""Every job kind's parameters: the one definition shared by the API and the workers."""

from __future__ import annotations

import json
from typing import Any

from lmscope.params.base import MAX_JOB_ID, MAX_SEED, ChildSpec, JobParams, KindSpec
from lmscope.params.entropy import EntropyParams
from lmscope.params.norms import NormsParams
from lmscope.params.operator import OperatorParams
from lmscope.params.probe import ProbeParams
from lmscope.params.pruning import PruningParams
from lmscope.params.sweep import AttentionApproxParams, SumformerFitParams, SweepParams, expand_sweep
from lmscope.params.train import TrainParams

KINDS: dict[str, KindSpec] = {
    spec.kind: spec
    for spec in [
        KindSpec("probe", ProbeParams, "load a model and report its layers, heads and parameter counts",
                 example={"model": "tiny-gpt2"}),
        KindSpec("train", TrainParams, "train a small causal LM on a dataset, with checkpoints",
                 example={"dataset": "wikitext-2", "layers": 2, "width": 64, "heads": 2, "context": 64,
                          "vocab_size": 512, "steps": 100, "warmup_steps": 10, "eval_every": 25,
                          "checkpoint_every": 50}),
        KindSpec("norms", NormsParams, "norm trajectories of the current token across layers (Wu & Varshney)",
                 example={"model": "tiny-gpt2", "dataset": "wikitext-2", "max_samples": 200}),
        KindSpec("entropy", EntropyParams, "attention-entropy curves per layer, head, position and step",
                 example={"model": "tiny-gpt2", "dataset": "wikitext-2", "seq_len": 128, "num_segments": 50}),
        KindSpec("pruning", PruningParams, "each attention head's term, and the loss as heads are removed (UAT)",
                 example={"model": "tiny-gpt2", "dataset": "wikitext-2", "seq_len": 128, "num_segments": 8,
                          "eval_segments": 8}),
        KindSpec("operator", OperatorParams, "how far each head's linear map W'(x) depends on its input (UAT)",
                 example={"model": "tiny-gpt2", "dataset": "wikitext-2", "seq_len": 128, "num_segments": 8}),
        # six points of Fig. 2's grid (example:fig2 is the documented reduced figure, `{}` the full-size one with one
        # seed: 100 children); the attention study's small one is example:attention_study_demo
        KindSpec("sweep", SweepParams, "approximation sweep; each grid point is a child job", expand=expand_sweep,
                 example={"study": "sumformer", "target": "fig2_poly", "architectures": ["mlp_sumformer"],
                          "grid": {"latent_dim": [1, 4, 16], "token_dim": [1, 2], "seq_len": [3], "seed": [0]},
                          "train": {"samples": 500, "epochs": 20, "hidden": 32, "depth": 3, "eval_every": 2}}),
        KindSpec("sumformer_fit", SumformerFitParams, "one grid point of a sumformer sweep", submittable=False),
        KindSpec("attention_approx", AttentionApproxParams, "one grid point of an attention study", submittable=False),
    ]
}


class UnknownKind(ValueError):
    pass


def validate_params(kind: str, raw: dict[str, Any] | None, *, internal: bool = False) -> JobParams:
    """Parse `raw` with the kind's model; raises UnknownKind or pydantic.ValidationError."""
    spec = KINDS.get(kind)
    if spec is None or (not spec.submittable and not internal):
        raise UnknownKind(kind)
    if internal:  # stored rows may be older, fuller dumps
        return spec.params.model_validate(raw or {}, context={"submitted": False})
    # A submission is JSON and is read as JSON, strictly: true is not 1 and "5" is not 5 (lax parsing
    # would run a job on a value nobody meant); arrays still fill tuples and objects nested models.
    # A whole-number float is that integer (1e4 from a command line, 5.0 from Python); a float field
    # takes it back as a float.
    return spec.params.model_validate_json(json.dumps(whole_floats_as_ints(raw or {})), strict=True,
                                           context={"submitted": True})


def whole_floats_as_ints(value: Any) -> Any:
    """5.0 → 5 anywhere in a JSON value: the canonical form of a submission (validation, idempotency).

    Only where the float is that integer exactly (|x| <= 2**53): 1e300 stays a float, which an integer
    field refuses, rather than becoming a 301-digit count.
    """
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: whole_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [whole_floats_as_ints(v) for v in value]
    return value


def is_parent_kind(kind: str) -> bool:
    """A sweep parent: its parameters expand into child jobs, and it runs an aggregation, not a job."""
    spec = KINDS.get(kind)
    return spec is not None and spec.expand is not None


def parent_kinds() -> list[str]:
    """The kinds whose jobs make child jobs (sorted): what a child kind is made by."""
    return sorted(k for k in KINDS if is_parent_kind(k))


__all__ = ["KINDS", "MAX_JOB_ID", "MAX_SEED", "ChildSpec", "JobParams", "KindSpec", "UnknownKind", "is_parent_kind",
           "parent_kinds", "validate_params", "whole_floats_as_ints"]
