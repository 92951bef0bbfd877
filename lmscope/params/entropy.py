from __future__ import annotations

from pydantic import Field

from lmscope.params.base import DType, JobParams


class EntropyParams(JobParams):
    """Attention entropy (placeholder; owned by the entropy issue)."""

    model: str | None = None
    models: list[str] | None = None
    train_job: int | None = None
    dataset: str
    seq_len: int = Field(512, ge=2)
    num_segments: int = Field(1000, ge=1)
    batch_size: int = Field(8, ge=1)
    dtype: DType = "float32"
    histogram_bins: int = Field(50, ge=2)
    dimension_wise: bool = False
    dimension_segments: int = Field(100, ge=1)
    near_uniform_margin: float = Field(0.03, gt=0)
    seed: int = 0

    def model_refs(self) -> list[str]:
        return [m for m in ([self.model] if self.model else []) + (self.models or [])]

    def dataset_refs(self) -> list[str]:
        return [self.dataset]

    def job_refs(self) -> list[int]:
        return [self.train_job] if self.train_job is not None else []
