"""What an analysis receives from the worker and what it returns.

An analysis is ``run(params, ctx) -> JobOutput``. It reads models and text through ``ctx``, reports
progress through ``ctx.progress`` (which raises ``JobCancelled`` once the user cancelled), writes its
files (plots, .npz) into ``ctx.artifact_dir`` and returns the headline numbers and the curves. The
worker stores everything in one transaction when the function returns, so a retried attempt replaces
what an earlier one wrote.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from lmscope.modeling.loaded import LoadedModel  # re-exported: analyses and the worker import it from here


class JobCancelled(Exception):
    """Raised inside an analysis when its job was cancelled; the worker marks the job cancelled.

    An analysis whose finished part is worth keeping (a training run's loss curve up to the cancel)
    catches it and raises ``JobCancelled(partial=JobOutput(...))``: the worker stores that output
    (summary, series, the artifact folder) with the cancelled status."""

    def __init__(self, *, partial: "JobOutput | None" = None):
        super().__init__("cancelled")
        self.partial = partial


class JobFailed(Exception):
    """An analysis refuses its input with a message that says what to change (not retried).

    ``partial``: what a job that fails part-way keeps, as with ``JobCancelled`` (a training run stopped
    by the time limit keeps its loss curve); the worker stores it with the failed status."""

    def __init__(self, message: str, *, error_type: str = "invalid-input", partial: "JobOutput | None" = None):
        super().__init__(message)
        self.error_type = error_type
        self.partial = partial


def overflow_advice(dtype: str) -> str:
    """What to change when a model's states reach inf or NaN in `dtype` (a job's "float16", "bfloat16"...)."""
    return ("float16 holds values up to 65504: run with dtype bfloat16 or float32" if dtype == "float16"
            else "are its weights finite?")


def eta_text(seconds: float) -> str:
    """A remaining time as a progress stage writes it: `7m05s`, `2h13m`."""
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def own_attention(model) -> str:
    """What a job records as its kernel_backend when the model runs its own attention: transformers-sdpa, ..."""
    return f"transformers-{model.config._attn_implementation}"


def context_seq_len(config, default: int) -> int:
    """The seq_len a job uses when none is given: ``default``, or the model's context when shorter."""
    from lmscope.modeling.loading import max_positions

    return min(default, max_positions(config) or default)


def require_positions(config, seq_len: int, model_name: str) -> None:
    """Refuse windows of ``seq_len`` tokens that a model cannot read (its position table is shorter)."""
    from lmscope.modeling.loading import max_positions

    max_pos = max_positions(config)
    if max_pos is not None and seq_len > max_pos:
        raise JobFailed(f"seq_len {seq_len} is longer than {model_name} supports ({max_pos} positions); "
                        f"lower seq_len to at most {max_pos}")


def dataset_windows(tokenizer, documents: list[str], params, model_name: str):
    """[W, seq_len] consecutive non-overlapping windows of the dataset's token stream, W <= num_segments
    (``params``: seq_len, num_segments, bos_per_window, dataset); with ``bos_per_window`` each is BOS and
    the next seq_len − 1 stream tokens. A tokenizer without BOS, or too few tokens, fails the job."""
    from lmscope.modeling.windows import token_windows

    if params.bos_per_window and tokenizer.bos_token_id is None:
        raise JobFailed(f"{model_name}'s tokenizer has no BOS token, so bos_per_window=true cannot start windows "
                        "with one; set bos_per_window=false")
    try:
        return token_windows(tokenizer, documents, params.seq_len, params.num_segments,
                             bos_first=params.bos_per_window)
    except ValueError as e:  # not even one full window
        raise JobFailed(f"dataset {params.dataset!r} with {model_name}'s tokenizer: {e}") from None


@dataclass
class Series:
    """One curve: y against x, with labels that say which curve it is (layer, head, ...)."""

    name: str
    x: Sequence[float]
    y: Sequence[float]
    labels: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobOutput:
    summary: dict[str, Any]
    series: list[Series] = field(default_factory=list)


@dataclass
class ChildResult:
    """What a sweep's aggregator sees of one finished child job."""

    job_id: int
    kind: str
    params: dict[str, Any]
    status: str
    summary: dict[str, Any] | None
    series: list[Series]
    error: str | None = None


class JobContext(Protocol):
    job_id: int
    attempt: int
    artifact_dir: Path  # emptied at the start of each attempt, except its `checkpoints/` folder
    device: str  # "cuda" or "cpu"
    # True when other jobs may run in this process at the same time (e.g. an embedded worker with
    # several threads): process-wide state (RNG seeds, torch settings, the model cache) is shared.
    shares_process: bool

    def progress(self, done: int, total: int, stage: str | None = None) -> None:
        """Report progress (throttled by the worker); raises JobCancelled if the job was cancelled."""

    def check_cancelled(self) -> None:
        """Raise JobCancelled if the user asked to cancel."""

    def stage(self, name: str) -> AbstractContextManager[None]:
        """Time a stage; the wall time per stage is recorded in the job's environment, and the worker shows the
        stage as the job's progress as soon as it begins."""

    def load_model(self, name: str, *, dtype: str = "float32") -> LoadedModel:
        """A registered model by name (cached by the worker)."""

    def load_tokenizer(self, name: str):
        """A registered model's tokenizer, without loading (or caching) its weights."""

    def load_documents(self, dataset: str) -> list[str]:
        """A registered dataset's documents, in file order."""

    def register_model(self, name: str, path: Path, *, step: int | None = None) -> None:
        """Register a Hugging Face directory (e.g. a training checkpoint) as a model (idempotent)."""

    def checkpoints_of(self, train_job_id: int) -> list[tuple[int, str]]:
        """(step, model name) of a train job's checkpoints, in step order."""

    def record(self, key: str, value: Any) -> None:
        """Add a fact to the job's environment record (e.g. the kernel backend used)."""
