from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmscope.params.base import JobParams


class TrainParams(JobParams):
    """Train a small causal LM on a registered dataset (placeholder; owned by the training issue)."""

    dataset: str
    architecture: Literal["gpt2", "llama"] = "gpt2"
    layers: int = Field(4, ge=1, le=48)
    width: int = Field(128, ge=8, le=4096)
    heads: int = Field(4, ge=1, le=64)
    context: int = Field(128, ge=8, le=8192)
    vocab_size: int = Field(2048, ge=260, le=65536)
    steps: int = Field(1000, ge=1, le=1_000_000)
    checkpoint_every: int = Field(250, ge=1)
    seed: int = 0

    def dataset_refs(self) -> list[str]:
        return [self.dataset]
