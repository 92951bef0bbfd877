from __future__ import annotations

from pydantic import Field

from lmscope.params.base import DType, JobParams


class ProbeParams(JobParams):
    """Load a model by name and report its architecture; one short forward pass checks it runs."""

    model: str = Field(description="a registered model name, e.g. tiny-gpt2")
    dtype: DType = "float32"
    prompt: str = Field("The quick brown fox jumps over the lazy dog.", min_length=1, max_length=10_000,
                        description="text whose mean next-token loss is reported (needs ≥ 2 tokens)")

    def model_refs(self) -> list[str]:
        return [self.model]
