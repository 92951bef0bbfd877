from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from lmscope.params.base import JobParams, Seed

DEFAULT_WARMUP_STEPS = 100  # the longest default warm-up; runs under 1000 steps warm up for a tenth
DEFAULT_CHECKPOINT_EVERY = 250
# Each checkpoint is a full copy of the weights and a registered model: a run's count is bounded so that
# one job cannot fill the shared disk and the model list (curves over training need tens, not thousands).
MAX_CHECKPOINTS = 100


def checkpoint_count(steps: int, every: int) -> int:
    """Checkpoints a run writes: step 0, every `every` steps, and the last step."""
    return 1 + -(-steps // every)


def fewest_checkpoint_every(steps: int) -> int:
    """The smallest checkpoint_every whose run writes at most MAX_CHECKPOINTS."""
    return -(-steps // (MAX_CHECKPOINTS - 1))


class TrainParams(JobParams):
    """Train a small causal LM (GPT-2 or LLaMA style) on a registered dataset, with HF checkpoints.

    AdamW, linear warm-up then cosine decay to ``lr * min_lr_ratio``; the last ``val_fraction`` of the
    documents is held out for validation. Checkpoints become models named ``<run_name>@step<N>``.
    """

    dataset: str = Field(description="a registered dataset name, e.g. wikitext-2")
    architecture: Literal["gpt2", "llama"] = "gpt2"
    layers: int = Field(4, ge=1, le=48)
    width: int = Field(128, ge=8, le=4096, description="hidden size d_model")
    heads: int = Field(4, ge=1, le=64)
    kv_heads: int | None = Field(None, ge=1, le=64, description="llama only: key/value heads (GQA); default = heads")
    context: int = Field(128, ge=8, le=8192, description="tokens per training window")
    tokenizer: str = Field("bpe", description='"bpe" (trained on the dataset), "bytes", or a registered model whose tokenizer to reuse')
    vocab_size: int = Field(2048, ge=260, le=65536, description="BPE vocabulary size (tokenizer=bpe; "
                            "ignored with the other tokenizers, which bring their own)")
    steps: int = Field(1000, ge=1, le=1_000_000, description="optimiser steps (one batch each)")
    batch_size: int = Field(16, ge=1, le=4096, description="windows of context + 1 tokens per step")
    lr: float = Field(1e-3, gt=0, le=1.0, description="peak learning rate (AdamW), after warm-up")
    warmup_steps: int | None = Field(None, ge=0, description="linear warm-up steps, then a cosine decay; "
                                     "default min(100, steps // 10)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine ends at lr × min_lr_ratio")
    weight_decay: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm; 0 = no clipping")
    checkpoint_every: int = Field(DEFAULT_CHECKPOINT_EVERY, ge=1,
                                  description="steps between checkpoints, each a model <run_name>@step<N>; step 0 "
                                  f"(untrained) and the last step are always written; at most {MAX_CHECKPOINTS} "
                                  "per run (left out, it is raised for a long run to keep within that)")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="the documents at the end held out for validation")
    eval_every: int = Field(100, ge=1, description="steps between validation losses (also at step 0 and the end)")
    eval_batches: int = Field(8, ge=1, le=1000, description="validation batches per evaluation")
    seed: Seed = 0
    run_name: str | None = Field(None, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                 description="checkpoint models are named <run_name>@step<N>; default run<job_id>")

    @field_validator("run_name")
    @classmethod
    def _not_a_default_name(cls, name: str | None) -> str | None:
        # run<N> is job N's default run name: taking it explicitly would clash with that job's checkpoints.
        if name is not None and re.fullmatch(r"run\d+", name):
            raise ValueError(f"run_name {name!r} is reserved (run<job id> is the default name); pick another, "
                             "e.g. 'my-run', or leave it out")
        return name

    @field_validator("checkpoint_every")
    @classmethod
    def _at_most_100_checkpoints(cls, every: int, info: ValidationInfo) -> int:
        # A stored row (a worker's re-validation) runs as it was accepted: a job submitted before the limit
        # must not fail its next attempt as invalid-params. (Left out, the value is raised instead: below.)
        stored = info.context is not None and info.context.get("submitted") is False
        steps = info.data.get("steps")
        if stored or steps is None or checkpoint_count(steps, every) <= MAX_CHECKPOINTS:
            return every
        fewest = fewest_checkpoint_every(steps)
        raise ValueError(f"checkpoint_every={every} over {steps} steps writes {checkpoint_count(steps, every)} "
                         f"checkpoints (step 0, one every {every} step{'s' if every > 1 else ''}, and the last); "
                         f"a run writes at most {MAX_CHECKPOINTS}: use checkpoint_every={fewest} or more")

    @model_validator(mode="after")
    def _check_shapes(self) -> "TrainParams":
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}; choose width = heads × head size")
        if self.architecture == "llama":
            if (self.width // self.heads) % 2:
                raise ValueError(f"head size {self.width // self.heads} is odd; rotary embeddings need an even head size")
            if self.kv_heads is not None and self.heads % self.kv_heads:
                raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        elif self.kv_heads is not None and self.kv_heads != self.heads:
            raise ValueError("kv_heads applies to architecture 'llama' only; leave it out for gpt2")
        if "checkpoint_every" not in self.model_fields_set and \
                checkpoint_count(self.steps, self.checkpoint_every) > MAX_CHECKPOINTS:
            self.checkpoint_every = fewest_checkpoint_every(self.steps)
        if self.warmup_steps is None:  # a tenth of a short run, as many runs use, at most 100 steps
            self.warmup_steps = min(DEFAULT_WARMUP_STEPS, self.steps // 10)
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be less than steps ({self.steps}); "
                             f"for a short run lower it too, e.g. warmup_steps={self.steps // 10}, or leave it out")
        return self

    def model_refs(self) -> list[str]:
        return [] if self.tokenizer in ("bpe", "bytes") else [self.tokenizer]

    def dataset_refs(self) -> list[str]:
        return [self.dataset]

    def model_prefixes(self) -> list[str]:
        # The default run<job id> needs no check: nobody else may take it (see _not_a_default_name).
        return [f"{self.run_name}@step"] if self.run_name else []
