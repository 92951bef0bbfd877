"""The base of every job kind's parameter model (light: pydantic only, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmscope.catalog import INT32_MAX

DType = Literal["float32", "bfloat16", "float16"]

# Job ids are INTEGER columns (32-bit in PostgreSQL): no job has a larger id, and a larger one in a
# query is an error there, not "no such job".
MAX_JOB_ID = INT32_MAX
JobId = Annotated[int, Field(ge=1, le=MAX_JOB_ID)]

# What every consumer of a seed takes: numpy's default_rng refuses negative seeds, torch's manual_seed
# overflows past 2**64 - 1 (and the workers add small offsets to a seed).
MAX_SEED = 2**63 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]

# Token windows of the analyses that cut a dataset's stream (entropy, the attention study)
BosPerWindow = Annotated[bool, Field(
    description="start every window with the tokenizer's BOS token followed by seq_len − 1 stream tokens "
                "(pretrained LLaMA-family models keep their position-0 attention sink); default: plain "
                "non-overlapping windows of the token stream")]


@dataclass(frozen=True)
class AttentionRead:
    """What a job reads from lmscope's attention function (which a model that computes its attention in its
    own modules never calls), worded for the 422 that refuses such a model at submit."""

    field: str  # the parameter the refusal points at
    models: list[str]
    reads: str  # "q and k", "attention weights": what lmscope would never see
    title: str
    advice: str = ""  # what to change besides studying another model, e.g. "set dimension_wise=false"


class JobParams(BaseModel):
    """Parameters of one job kind. Unknown fields are an error (422 naming the field), and so is a
    float that is not finite: JSON has no inf, but an integer like 10**400 becomes one as a float."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def model_refs(self) -> list[str]:
        """Registered model names this job reads (checked at submit)."""
        return []

    def dataset_refs(self) -> list[str]:
        """Registered dataset names this job reads (checked at submit)."""
        return []

    def job_refs(self) -> list[int]:
        """Other jobs this job reads (e.g. a `train` job's checkpoints), checked at submit."""
        return []

    def positions_read(self) -> tuple[str, int] | None:
        """(field, value) when the job feeds its models windows of `value` positions; checked at
        submit against each model's context length (and a `train` job's ``context``)."""
        return None

    def layers_read(self) -> tuple[str, str, list[int]] | None:
        """(field, model, layer indices) when the job reads given layers of a registered model; checked
        at submit against the model's number of layers."""
        return None

    def attention_read(self) -> AttentionRead | None:
        """The models whose layers' q and k or attention weights the job reads from lmscope's attention
        function (the entropy job's dimension-wise part, the operator job), or None; checked at submit
        against architectures that compute their attention in their own modules."""
        return None

    def model_size_refusal(self, layers: int, heads: int, max_positions: int | None) -> tuple[str, str] | None:
        """(field, why) when the job cannot run on a model of this many layers and heads (and context length,
        None when unrecorded), e.g. over a memory limit; checked at submit from each model's recorded facts."""
        return None

    def softmax_attention_read(self) -> str | None:
        """The model whose layers' q, k, v the job compares with its own softmax attention (the attention
        study), or None; checked at submit against architectures whose attention cannot be read so."""
        return None

    def models_compared(self) -> tuple[str, list[str]] | None:
        """(field, models) when the job follows the same layers and heads across several models;
        checked at submit: their recorded numbers of layers and heads must agree."""
        return None

    def stored(self) -> dict[str, Any]:
        """The params as the job row keeps them (and `lmscope show` prints them): validated, defaults
        filled in. Validating this dict again gives the same params."""
        return self.model_dump(mode="json")

    def model_prefixes(self) -> list[str]:
        """Prefixes of the model names this job will register (e.g. "demo@step"); at submit, no
        existing model may start with one of them."""
        return []


class ModelSource(JobParams):
    """Parameters of a job that measures one model or several (a training run's checkpoints): exactly one
    of ``model``, ``models`` or ``train_job``."""

    model: str | None = Field(None, description="one registered model, e.g. tiny-gpt2")
    models: list[str] | None = Field(
        None, min_length=1, max_length=1000,
        description="several registered models (e.g. checkpoints run@step100, run@step500); "
                    "x = the @step<N> suffix when every name has one, else the list index")
    train_job: JobId | None = Field(None, description="a train job id: all its checkpoints in step order")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSource":
        given = [name for name in ("model", "models", "train_job") if getattr(self, name) is not None]
        if len(given) != 1:
            said = f"got {' and '.join(given)} (set all but one to null)" if given else "got none"
            raise ValueError(
                "give exactly one of 'model' (a registered model), 'models' (a list of models) "
                f"or 'train_job' (a train job id) — {said}")
        if self.models is not None and len(set(self.models)) != len(self.models):
            raise ValueError("'models' lists a model twice; give each model once")
        return self

    def model_refs(self) -> list[str]:
        return ([self.model] if self.model else []) + list(self.models or [])

    def job_refs(self) -> list[int]:
        return [self.train_job] if self.train_job is not None else []

    def models_compared(self) -> tuple[str, list[str]] | None:
        return ("models", list(self.models)) if self.models and len(self.models) > 1 else None


@dataclass
class ChildSpec:
    """One grid point of a sweep: an ordinary job created with the parent."""

    kind: str
    params: dict[str, Any]
    name: str
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class KindSpec:
    kind: str
    params: type[JobParams]
    description: str
    submittable: bool = True
    # For parent kinds (sweeps): the grid points, computed at submit time.
    expand: Callable[[Any], list[ChildSpec]] | None = None
    # Params of a small job of this kind on the built-ins (tiny-gpt2, wikitext-2) that ends in under a minute
    # on a CPU: where the dashboard's submit form starts, and what `lmscope kinds KIND` shows to submit.
    example: dict[str, Any] | None = None
