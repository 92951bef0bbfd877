"""Parameters of the `norms` job kind (Wu & Varshney; docs/analyses/norms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmscope.params.base import DType, JobParams, Seed


class NormsParams(JobParams):
    """Norm trajectories of the current token across layers, the inner loss, PCA and the Gram condition."""

    model: str = Field(description="registered model name")
    dataset: str = Field(description="registered dataset name; each document/paragraph is one sample")
    max_samples: int = Field(5000, ge=1, description="use at most this many documents (in dataset order)")
    min_words: int = Field(10, ge=0, description="skip documents with fewer words")
    max_tokens: int = Field(256, ge=2, le=32768, description="the model reads at most this many tokens per sample")
    position: Literal["last", "all"] = Field(
        "last", description="'last': the last token read is the current token; 'all': every position ≥ min_position")
    min_position: int = Field(5, ge=0, description="first current-token position when position='all'")
    include_last_layer: bool = Field(False, description="add the last block's output (before the final norm)")
    inner_loss: bool = Field(True, description="compute the approximate inner loss per layer (eq. 14)")
    loss_filter: float | None = Field(
        1.0, ge=0, description="keep trajectories whose inner loss at the last layer is ≤ this; null keeps all")
    pca_samples: int = Field(50, ge=0, description="trajectories drawn in the 3-D PCA plot and saved in pca.npz")
    gram_condition: bool = Field(True, description="check Proposition 1's condition (blocks with a plain FFN: GPT-2, GPTBigCode, BLOOM, StarCoder2; GPT-NeoX and Phi, whose parallel residual gives I + W_MHSA + W_FFN)")
    gram_samples: int = Field(200, ge=0, description="trajectories on which the Gram condition is checked")
    batch_size: int = Field(16, ge=1, le=1024)
    dtype: DType = "float32"
    seed: Seed = Field(0, description="which trajectories are plotted / used for PCA and the Gram condition")

    @model_validator(mode="after")
    def _check_positions(self):
        if self.position == "all" and self.min_position >= self.max_tokens:
            raise ValueError(f"min_position={self.min_position} must be below max_tokens={self.max_tokens}: "
                             "the model reads max_tokens tokens, so no position would be a current token")
        return self

    def model_refs(self) -> list[str]:
        return [self.model]

    def dataset_refs(self) -> list[str]:
        return [self.dataset]
