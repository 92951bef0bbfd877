"""Parameters of the `pruning` job kind (Wang & Li's UAT; docs/analyses/pruning.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lmscope.params.base import BosPerWindow, DType, ModelSource, Seed

DEFAULT_SEQ_LEN = 256
# the default; least_harm_first needs single_head_ablation, least_important_first gradient_importance
ORDERS = ("smallest_first", "largest_first", "random")
Order = Literal["smallest_first", "largest_first", "random", "least_harm_first", "least_important_first",
                "least_important_iterative"]
IMPORTANCE_ORDERS = ("least_important_first", "least_important_iterative")
Unit = Literal["head", "kv_group", "layer"]


class PruningParams(ModelSource):
    """What each attention head's term adds to the residual stream, and what removing heads costs.

    Multi-head attention is a sum of per-head terms, each linear in the layer's input once the attention
    weights are fixed (MHA(x) = W'(x)·x). The job measures every head's term on ``num_segments`` windows,
    then removes heads in order of their measured size (and in the opposite and in random orders) and
    evaluates the model's next-token loss on ``eval_segments`` further windows. Give exactly one of ``model``,
    ``models`` or ``train_job`` (a `train` job's checkpoints): with several, each is measured and pruned, and
    the results follow the heads across them.
    """

    dataset: str = Field(description="a registered dataset; its token stream is cut into windows")
    seq_len: int | None = Field(
        None, ge=2, le=131072,
        description=f"tokens per window; default {DEFAULT_SEQ_LEN}, or the (first) model's context length when shorter")
    num_segments: int = Field(32, ge=1, le=100_000, description="windows on which the heads' terms are measured")
    eval_segments: int = Field(32, ge=1, le=100_000,
                               description="the next windows of the stream, on which the pruned models' loss is "
                                           "evaluated (none of them is a measured window)")
    unit: Unit = Field("head", description="what is measured and removed: one query head; a key/value group (the "
                                           "query heads that read one key/value head, so removing it frees that "
                                           "head's K and V); or a layer's whole attention (all its heads)")
    fractions: list[float] = Field(
        [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0], min_length=1, max_length=101,
        description="shares of all units (layers × heads, groups or layers) removed at each point, rounded to whole "
                    "units; increasing")
    orders: list[Order] = Field(list(ORDERS), min_length=1, max_length=6,
                                description="in which order heads are removed: smallest_first (the smallest "
                                            "measured term first), largest_first, random, least_harm_first (the "
                                            "smallest single-head loss increase first; needs single_head_ablation), "
                                            "least_important_first (the smallest gradient importance first; needs "
                                            "gradient_importance), least_important_iterative (Michel et al.'s "
                                            "procedure: before each point of fractions the gradient importance is "
                                            "taken again with the heads so far removed, and the least important of "
                                            "the rest go next; needs gradient_importance)")
    random_orders: int = Field(3, ge=1, le=100, description="random orders drawn (from seed) when orders has random")
    tolerance: float = Field(0.01, gt=0, le=10, description="a relative loss increase up to this counts as harmless "
                                                           "in the summary's prunable fraction")
    single_head_ablation: bool = Field(
        False, description="also remove each head alone on the measured windows (layers × heads more passes over "
                           "them): its loss increase, the rank correlation with the measured terms, and the order "
                           "least_harm_first")
    gradient_importance: bool = Field(
        False, description="also take each head's gradient importance on the measured windows (Michel et al. 2019: "
                           "the mean over windows of |∂loss/∂gate| with the head's output scaled by a gate at 1; one "
                           "forward and backward pass per batch): its rank correlation with the measured terms, the "
                           "first-order estimate of each head's single-head loss increase, and the order "
                           "least_important_first")
    normalize_importance: bool = Field(
        False, description="rank by each layer's gradient importances divided by their L2 norm over the layer's "
                           "units (Michel et al. 2019's layer-wise normalisation), in least_important_first and "
                           "least_important_iterative; the reported importances stay unnormalised. Not with "
                           "unit='layer' (one unit per layer: every layer would rank 1)")
    batch_size: int = Field(8, ge=1, le=4096, description="windows per forward pass")
    dtype: DType = "float32"
    bos_per_window: BosPerWindow = False
    seed: Seed = Field(0, description="draws the random orders")

    @field_validator("fractions")
    @classmethod
    def _increasing_shares(cls, fractions: list[float]) -> list[float]:
        outside = [f for f in fractions if not 0.0 <= f <= 1.0]
        if outside:
            raise ValueError(f"fractions are shares of the heads, from 0 to 1; {outside} is outside")
        if any(b <= a for a, b in zip(fractions, fractions[1:])):
            raise ValueError("list fractions in increasing order, each once (e.g. [0, 0.25, 0.5])")
        return fractions

    @field_validator("orders")
    @classmethod
    def _each_order_once(cls, orders: list[str]) -> list[str]:
        if len(set(orders)) != len(orders):
            raise ValueError("'orders' lists an order twice; give each once")
        return orders

    @model_validator(mode="after")
    def _measures_for_their_orders(self) -> "PruningParams":
        if "least_harm_first" in self.orders and not self.single_head_ablation:
            raise ValueError("the order least_harm_first ranks heads by removing each alone: set "
                             "single_head_ablation to true, or drop least_harm_first from orders")
        for order in IMPORTANCE_ORDERS:
            if order in self.orders and not self.gradient_importance:
                raise ValueError(f"the order {order} ranks heads by their gradient importance: set "
                                 f"gradient_importance to true, or drop {order} from orders")
        if self.normalize_importance and self.unit == "layer":
            raise ValueError("normalize_importance divides each layer's importances by their norm over the layer's "
                             "units; with unit='layer' there is one per layer and every layer would rank 1: set "
                             "normalize_importance to false, or unit to 'head' or 'kv_group'")
        if self.normalize_importance and not set(IMPORTANCE_ORDERS) & set(self.orders):
            raise ValueError("normalize_importance changes only the importance orders: add least_important_first "
                             "or least_important_iterative to orders (they need gradient_importance=true), or set "
                             "normalize_importance to false")
        return self

    def dataset_refs(self) -> list[str]:
        return [self.dataset]

    def positions_read(self) -> tuple[str, int] | None:
        return ("seq_len", self.seq_len) if self.seq_len is not None else None
