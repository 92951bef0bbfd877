"""Parameters of the `operator` job kind: how far each head's linear map W'(x) depends on its input (UAT)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lmscope.params.base import AttentionRead, BosPerWindow, DType, ModelSource

DEFAULT_SEQ_LEN = 256
Replacement = Literal["other_window", "mean", "uniform"]
REPLACEMENTS: tuple[Replacement, ...] = ("other_window", "mean", "uniform")
MEAN_ATTENTION_BYTES = 4 << 30  # Ā for every layer and head, summed in float64: refused above this


class OperatorParams(ModelSource):
    """Multi-head attention is an input-dependent linear map, MHA(x) = W'(x)·x: each head mixes the values
    x_j W_V^h with weights A_h(x) that the input chose. The job replaces each head's weights by ones the
    window did not choose (another window's, their mean over windows, or uniform over the visible keys)
    and measures how far the head's term moves: 0 for a head whose map is the same on every input, about 1
    or more for one whose map the input decides. Give exactly one of ``model``, ``models`` or ``train_job``.
    """

    dataset: str = Field(description="a registered dataset; its token stream is cut into windows")
    seq_len: int | None = Field(
        None, ge=2, le=16384,
        description=f"tokens per window; default {DEFAULT_SEQ_LEN}, or the (first) model's context length when "
                    "shorter (the job materialises every layer's attention weights: memory grows with seq_len²)")
    num_segments: int = Field(32, ge=2, le=100_000, description="windows measured (at least two: other_window "
                                                                "takes a window's attention weights from another)")
    replacements: list[Replacement] = Field(
        list(REPLACEMENTS), min_length=1, max_length=3,
        description="what replaces a window's own attention weights A_h(x): other_window (the window's before it "
                    "in its batch, cyclically), mean (A_h averaged over the measured windows: a fixed pattern of "
                    "positions), uniform (1 / visible keys: mean pooling)")
    batch_size: int = Field(8, ge=2, le=4096, description="windows per forward pass (other_window pairs the "
                                                          "windows of one batch)")
    dtype: DType = "float32"
    bos_per_window: BosPerWindow = False

    @field_validator("replacements")
    @classmethod
    def _each_replacement_once(cls, replacements: list[str]) -> list[str]:
        if len(set(replacements)) != len(replacements):
            raise ValueError("'replacements' lists a replacement twice; give each once")
        return replacements

    def dataset_refs(self) -> list[str]:
        return [self.dataset]

    def positions_read(self) -> tuple[str, int] | None:
        return ("seq_len", self.seq_len) if self.seq_len is not None else None

    def attention_read(self) -> AttentionRead:
        # a train_job's checkpoints are GPT-2 or LLaMA (model_refs is empty then): always readable
        return AttentionRead("model" if self.model else "models", self.model_refs(), "attention weights",
                             "The operator job cannot read this model's attention")

    def mean_attention_refusal(self, layers: int, heads: int, seq_len: int) -> str | None:
        """Why `mean` cannot run on a model of this shape (its float64 sums over the memory limit), or None."""
        size = 8 * layers * heads * seq_len ** 2
        if "mean" not in self.replacements or size <= MEAN_ATTENTION_BYTES:
            return None
        return (f"the mean attention pattern of {layers} layers × {heads} heads at seq_len {seq_len} takes "
                f"{size / 2**30:.1f} GiB (at most {MEAN_ATTENTION_BYTES >> 30} GiB): lower seq_len or drop 'mean' "
                "from replacements")

    def model_size_refusal(self, layers: int, heads: int, max_positions: int | None) -> tuple[str, str] | None:
        seq_len = self.seq_len or (min(DEFAULT_SEQ_LEN, max_positions) if max_positions else DEFAULT_SEQ_LEN)
        why = self.mean_attention_refusal(layers, heads, seq_len)
        return ("replacements", why) if why else None
