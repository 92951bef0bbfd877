"""Parameters of the `entropy` job kind: attention-entropy curves per layer, head, position and step."""

from __future__ import annotations

from pydantic import Field

from lmscope.params.base import AttentionRead, BosPerWindow, DType, ModelSource, Seed

DEFAULT_SEQ_LEN = 512


class EntropyParams(ModelSource):
    """Entropy of every attention row (a distribution over the visible keys), on one model or a run.

    Give exactly one of ``model`` (one registered model), ``models`` (a list, e.g. checkpoints
    ``run@step500``) or ``train_job`` (a `train` job's id: all its checkpoints in step order).
    """

    dataset: str = Field(description="a registered dataset; its token stream is cut into windows")
    seq_len: int | None = Field(
        None, ge=2, le=131072,
        description=f"tokens per window; default {DEFAULT_SEQ_LEN}, or the (first) model's context length when shorter")
    num_segments: int = Field(1000, ge=1, le=1_000_000, description="non-overlapping windows per model")
    batch_size: int = Field(8, ge=1, le=4096, description="windows per forward pass")
    dtype: DType = "float32"
    histogram_bins: int = Field(50, ge=2, le=10_000, description="bins from 0 to ln(seq_len) nats")
    dimension_wise: bool = Field(False, description="also the entropy of softmax(q_i k_i^T/sqrt(d)) per dimension i")
    dimension_segments: int = Field(100, ge=1, le=1_000_000, description="windows used for the dimension-wise entropy")
    dimension_causal: bool = Field(
        False, description="dimension-wise rows see only earlier keys (bound ln(position+1)); "
                           "default bidirectional as in the note (bound ln(seq_len))")
    near_uniform_margin: float = Field(0.03, gt=0, description="nats below the uniform bound that count as near uniform")
    bos_per_window: BosPerWindow = False
    seed: Seed = Field(0, description="unused: the measurement draws no random numbers (kept so that stored "
                                      "jobs stay valid)")

    def dataset_refs(self) -> list[str]:
        return [self.dataset]

    def positions_read(self) -> tuple[str, int] | None:
        return ("seq_len", self.seq_len) if self.seq_len is not None else None

    def attention_read(self) -> AttentionRead | None:
        if not self.dimension_wise:
            return None
        return AttentionRead("dimension_wise", self.model_refs(), "q and k",
                             "Dimension-wise entropy cannot read this model",
                             "set dimension_wise=false (the per-head entropies are still measured)")
