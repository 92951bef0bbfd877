from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmscope.params.base import DType, JobParams


class NormsParams(JobParams):
    """Norm trajectories (placeholder; owned by the norms issue)."""

    model: str
    dataset: str
    max_samples: int = Field(5000, ge=1)
    min_words: int = Field(10, ge=0)
    max_tokens: int = Field(256, ge=2)
    position: Literal["last", "all"] = "last"
    min_position: int = Field(5, ge=0)
    include_last_layer: bool = False
    inner_loss: bool = True
    loss_filter: float | None = 1.0
    pca_samples: int = Field(50, ge=0)
    gram_condition: bool = True
    gram_samples: int = Field(200, ge=0)
    batch_size: int = Field(16, ge=1, le=1024)
    dtype: DType = "float32"
    seed: int = 0

    def model_refs(self) -> list[str]:
        return [self.model]

    def dataset_refs(self) -> list[str]:
        return [self.dataset]
