from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from lmscope.params.base import ChildSpec, JobParams


class SumformerFitParams(JobParams):
    """One grid point of a sumformer sweep (placeholder; owned by the sweep issue)."""

    target: str = "fig2_poly"
    architecture: str = "poly_sumformer"
    latent_dim: int = 8
    token_dim: int = 1
    seq_len: int = 3
    features: int | None = None
    seed: int = 0
    train: dict[str, Any] = Field(default_factory=dict)


class AttentionApproxParams(JobParams):
    """One grid point of an attention study (placeholder; owned by the sweep issue)."""

    model: str
    dataset: str
    method: Literal["performer", "linformer"] = "performer"
    features: list[int] = Field(default_factory=lambda: [16, 32])

    def model_refs(self) -> list[str]:
        return [self.model]

    def dataset_refs(self) -> list[str]:
        return [self.dataset]


class SweepParams(JobParams):
    """A sweep (placeholder; owned by the sweep issue)."""

    study: Literal["sumformer", "attention"] = "sumformer"
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    model: str | None = None
    dataset: str | None = None

    def model_refs(self) -> list[str]:
        return [self.model] if self.model else []

    def dataset_refs(self) -> list[str]:
        return [self.dataset] if self.dataset else []


def expand_sweep(params: SweepParams) -> list[ChildSpec]:
    """The sweep's grid points as child jobs (placeholder: latent_dim × seed)."""
    children = []
    for d in params.grid.get("latent_dim", [8]):
        for seed in params.grid.get("seed", [0]):
            children.append(
                ChildSpec("sumformer_fit", {"latent_dim": d, "seed": seed}, name=f"latent_dim={d} seed={seed}")
            )
    return children
