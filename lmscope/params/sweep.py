"""Parameters of approximation sweeps (DESIGN.md §7 "sweep") and their grid expansion.

A `sweep` job is a parent; every grid point is an ordinary child job:

- study "sumformer": one `sumformer_fit` child per (architecture, target, token_dim d, seq_len n,
  latent_dim d', features k, seed). It trains one network on one equivariant target.
- study "attention": one `attention_approx` child per (method, seed). It captures every layer's
  q, k, v from a real model once and compares Performer / Linformer with exact softmax attention
  for every number of features k.

Light on purpose (pydantic + stdlib): the API expands the grid at submit time and has no torch.
The targets' maths lives in `lmscope.analyses.targets`; their names and formulas live here so that
the API can refuse an unknown target with the list of known ones.
"""

from __future__ import annotations

import itertools
from math import comb
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lmscope.params.base import BosPerWindow, ChildSpec, JobParams, Seed

Architecture = Literal["poly_sumformer", "mlp_sumformer", "transformer", "linformer", "performer"]
USES_FEATURES = ("linformer", "performer")  # k random features (Performer) / k projected keys (Linformer)
ApproxMethod = Literal["performer", "linformer"]
# How the attention study draws Linformer's E, F ∈ R^(k×N) (docs/analyses/sweep.md has the measurements):
# - "pooling" (default): E = F = the mean over k contiguous blocks of positions (the paper's pooling
#   variant): error falls with k and is exactly 0 at k ≥ N.
# - "shared": E = F = R, one Gaussian R with i.i.d. N(0, 1/k) entries (the paper's JL argument uses one
#   R, scaled as E = δR and F = e^(−δ)R; those two scalars are left out here).
# - "gaussian": E and F drawn independently, N(0, 1/k) each (an ablation: the pairing of keys with
#   values is lost).
# Untrained random projections (shared or not) do not approximate softmax attention: their error
# falls towards ≈ 1 as k grows, never towards 0; only pooling gives a curve that goes to 0.
LinformerProjection = Literal["pooling", "shared", "gaussian"]
DEFAULT_LINFORMER_PROJECTION = "pooling"

# Equivariant targets f(X)_i = g(x_i, {x_k : k != i}), applied to every coordinate c separately:
# f(X)_{i,c} = g(x_{i,c}, {x_{k,c} : k != i}), tokens x_k uniform on [0,1]^d. In the formulas x1 is
# the token the output belongs to and x2..xn the others (a set: g is invariant in them).
TARGET_FORMULAS: dict[str, str] = {
    "fig2_poly": "g = x1 + 7·x1² + 3·x1·(x2 + … + xn)³   (the paper's Fig. 2 target)",
    "poly_moments": "g = x1·(x2 + … + xn) + (x2² + … + xn²)   (degree 2; linear in x1², x1·p1, p2)",
    "sin_exp": "g = sin(2π·x1) + exp(−Σ_{k≥2} (xk − x1)²)   (smooth, not a polynomial)",
    "max_dist": "g = max_{k≥2} |xk − x1|   (Lipschitz, not smooth)",
}

# Bounds that keep one child a few minutes on a GPU and keep the API's expansion cheap.
MAX_LATENT_DIM = 4096
MAX_GRID_LIST = 64
MAX_GRID_POINTS = 100_000  # absurd grids are refused before expansion; the per-user limit is the API's

# Each value's bounds, once: a sweep's lists hold them, its grid points take one each.
LatentDim = Annotated[int, Field(ge=1, le=MAX_LATENT_DIM)]
TokenDim = Annotated[int, Field(ge=1, le=32)]
SumformerSeqLen = Annotated[int, Field(ge=2, le=256)]
FeatureCount = Annotated[int, Field(ge=1, le=65536)]  # k: random features (Performer) / projected keys (Linformer)
LayerIndex = Annotated[int, Field(ge=0)]
AttentionSeqLen = Annotated[int, Field(ge=2, le=65536)]
DEFAULT_ATTENTION_SEQ_LEN = 512
# Defaults stored rows may hold from before they changed (a full dump of the other study's fields)
FORMER_DEFAULTS = {"seq_len": 512}
ATTENTION_SEQ_LEN_ABOUT = (f"tokens per window; default {DEFAULT_ATTENTION_SEQ_LEN}, or the model's context length "
                           "when shorter")
SegmentCount = Annotated[int, Field(ge=1, le=100_000)]
WindowBatch = Annotated[int, Field(ge=1, le=1024)]
DEFAULT_ATTENTION_FEATURES = (16, 32, 64, 128, 256, 512, 1024)

# Which SweepParams fields belong to which study (setting the other study's fields is an error).
SUMFORMER_FIELDS = ("target", "architectures", "grid", "train")
ATTENTION_FIELDS = ("model", "dataset", "layers", "methods", "features", "seq_len", "num_segments",
                    "batch_size", "linformer_projection", "bos_per_window", "seeds")


def _mark_studies(schema: dict) -> None:
    for study, fields in (("sumformer", SUMFORMER_FIELDS), ("attention", ATTENTION_FIELDS)):
        for name in fields:
            schema["properties"][name]["x-study"] = study


def theory_latent_dim(token_dim: int, seq_len: int) -> int:
    """d' = C(n+d, d) − 1: the number of monomials x^α with 1 ≤ |α| ≤ n in d variables.

    The multisymmetric power sums Σ_k x_k^α over these α determine a set of n points in R^d
    (the Sumformer paper's polynomial construction), so this latent size always suffices.
    """
    return comb(seq_len + token_dim, token_dim) - 1


def effective_latent_dim(architecture: str, latent_dim: int | None, token_dim: int, seq_len: int) -> int:
    """The latent size a child really uses.

    `None` means the theory d'. The polynomial Sumformer has at most the theory d' monomials: a
    larger request is clamped to it, a smaller one keeps the first d' monomials in graded order
    (all of degree 1, then degree 2, ...), i.e. a truncated power-sum embedding.
    """
    theory = theory_latent_dim(token_dim, seq_len)
    if latent_dim is None:
        return theory
    return min(latent_dim, theory) if architecture == "poly_sumformer" else latent_dim


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TrainSettings(_Strict):
    """How one sumformer_fit child trains: Adam on the MSE, relative L2 error on a held-out split."""

    samples: int = Field(2000, ge=10, le=1_000_000, description="sequences drawn uniformly from [0,1]^(n×d)")
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    epochs: int = Field(200, ge=1, le=100_000)
    batch_size: int = Field(64, ge=1, le=1_000_000)
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    hidden: int = Field(50, ge=1, le=4096, description="width of every hidden layer of φ and ψ")
    depth: int = Field(5, ge=1, le=32, description="number of hidden layers of φ and ψ")
    eval_every: int = Field(5, ge=1, description="epochs between validation errors")
    qk_init_std: float = Field(
        0.01, ge=0.0, le=1.0,
        description="std of the attention's query/key weights at start; 0 = exactly the proof's construction "
                    "(uniform attention; for transformer and linformer the query/key weights then get zero "
                    "gradient and stay 0, the performer's keys do not)")
    linformer_projections: Literal["trained", "fixed"] = Field(
        "trained", description="linformer's E, F: trained from the proof's values (as in Linformer; not "
                               "permutation-equivariant once trained) or fixed at them (E = 1/n·1, F = 1/k·1)")

    @property
    def val_samples(self) -> int:
        """How many of the samples are the validation split (the rest are trained on)."""
        return int(round(self.samples * self.val_fraction))

    @model_validator(mode="after")
    def _split_has_both_sides(self):
        if self.val_samples < 1 or self.samples - self.val_samples < 1:
            raise ValueError(f"samples={self.samples} with val_fraction={self.val_fraction} leaves an empty "
                             "training or validation split; raise samples or change val_fraction")
        return self


def _check_target(name: str) -> str:
    if name not in TARGET_FORMULAS:
        raise ValueError(f"unknown target {name!r}; known targets: {', '.join(TARGET_FORMULAS)}")
    return name


def _check_latent(architecture: str, latent_dim: int | None, token_dim: int, seq_len: int) -> None:
    d_eff = effective_latent_dim(architecture, latent_dim, token_dim, seq_len)
    if d_eff > MAX_LATENT_DIM:
        raise ValueError(
            f"{architecture} with token_dim={token_dim}, seq_len={seq_len} and "
            f"latent_dim={'null (the theory)' if latent_dim is None else latent_dim} needs "
            f"d'={d_eff} latent dimensions (theory C(n+d,d)-1 = {theory_latent_dim(token_dim, seq_len)}); "
            f"give an explicit latent_dim ≤ {MAX_LATENT_DIM} or a smaller token_dim/seq_len")


class SumformerFitParams(JobParams):
    """One grid point of a sumformer sweep: train one architecture on one target."""

    target: str = "fig2_poly"
    architecture: Architecture = "mlp_sumformer"
    latent_dim: LatentDim | None = Field(None, description="d'; null = C(n+d,d)−1")
    token_dim: TokenDim = 1
    seq_len: SumformerSeqLen = 3
    features: FeatureCount | None = Field(None, description="k, for linformer / performer")
    seed: Seed = 0
    train: TrainSettings = Field(default_factory=TrainSettings)
    latent_dim_requested: list[int] | None = Field(
        None, description="the sweep grid's d′ values that were clamped to this child's d′ (poly_sumformer "
                          "d′ > C(n+d,d)−1); set by the sweep's expansion, said in the child's summary")

    @field_validator("target")
    @classmethod
    def _known_target(cls, v: str) -> str:
        return _check_target(v)

    @model_validator(mode="after")
    def _consistent(self):
        if self.architecture in USES_FEATURES and self.features is None:
            raise ValueError(f"architecture {self.architecture!r} needs features (k)")
        _check_latent(self.architecture, self.latent_dim, self.token_dim, self.seq_len)
        return self


class AttentionApproxParams(JobParams):
    """One grid point of an attention study: one method, one seed, every layer and every k."""

    model: str
    dataset: str
    method: ApproxMethod = "performer"
    features: list[FeatureCount] = Field(default_factory=lambda: list(DEFAULT_ATTENTION_FEATURES), min_length=1)
    layers: list[LayerIndex] | None = Field(None, description="layer indices; null = all layers")
    seq_len: AttentionSeqLen | None = Field(None, description=ATTENTION_SEQ_LEN_ABOUT)
    num_segments: SegmentCount = 16
    batch_size: WindowBatch = 4
    linformer_projection: LinformerProjection = DEFAULT_LINFORMER_PROJECTION
    bos_per_window: BosPerWindow = False
    seed: Seed = 0

    @field_validator("features")
    @classmethod
    def _ascending(cls, v):
        return sorted(set(v))

    def model_refs(self) -> list[str]:
        return [self.model]

    def dataset_refs(self) -> list[str]:
        return [self.dataset]

    def positions_read(self) -> tuple[str, int] | None:
        return ("seq_len", self.seq_len) if self.seq_len is not None else None

    def layers_read(self) -> tuple[str, str, list[int]] | None:
        return ("layers", self.model, self.layers) if self.layers is not None else None

    def softmax_attention_read(self) -> str | None:
        return self.model


class SumformerGrid(_Strict):
    """Lists whose product is the sweep (features only multiplies linformer / performer)."""

    # Bounds per item: an error names the value (loc grid.token_dim.3), and C(n+d, d) stays cheap.
    latent_dim: list[LatentDim | None] = Field(
        default_factory=lambda: [2**i for i in range(10)], min_length=1, max_length=MAX_GRID_LIST)
    token_dim: list[TokenDim] = Field(default_factory=lambda: list(range(1, 11)), min_length=1, max_length=MAX_GRID_LIST)
    seq_len: list[SumformerSeqLen] = Field(default_factory=lambda: [3], min_length=1, max_length=MAX_GRID_LIST)
    features: list[FeatureCount] = Field(default_factory=lambda: [8], min_length=1, max_length=MAX_GRID_LIST)
    seed: list[Seed] = Field(default_factory=lambda: [0], min_length=1, max_length=MAX_GRID_LIST)

    @field_validator("latent_dim", "token_dim", "seq_len", "features", "seed")
    @classmethod
    def _unique(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"grid values must be distinct, got {v}")
        return v


class SweepParams(JobParams):
    """A sweep: study "sumformer" (train a grid of networks) or "attention" (approximate a model's attention).

    The defaults are the paper's Fig. 2 at full size: MLP Sumformer on `fig2_poly`, n = 3,
    d = 1..10, d' = 1, 2, 4, ..., 512, 200 epochs on 2,000 sequences.
    """

    # The JSON schema marks each field with the study it belongs to ("x-study"; `lmscope kinds sweep`).
    model_config = ConfigDict(json_schema_extra=_mark_studies)

    study: Literal["sumformer", "attention"] = Field(
        "sumformer", description="sumformer: train a grid of networks on a target function; attention: compare "
                                 "Performer/Linformer with a model's softmax attention")

    # study = "sumformer"
    target: str | list[str] = Field("fig2_poly", description="a target or a list of them: "
                                                              + ", ".join(TARGET_FORMULAS))
    architectures: list[Architecture] = Field(default_factory=lambda: ["mlp_sumformer"], min_length=1)
    grid: SumformerGrid = Field(default_factory=SumformerGrid)
    train: TrainSettings = Field(default_factory=TrainSettings)

    # study = "attention"
    model: str | None = None
    dataset: str | None = None
    layers: list[LayerIndex] | None = Field(None, min_length=1, description="layer indices; null = all layers")
    methods: list[ApproxMethod] = Field(default_factory=lambda: ["performer", "linformer"], min_length=1)
    features: list[FeatureCount] = Field(default_factory=lambda: list(DEFAULT_ATTENTION_FEATURES), min_length=1,
                                         max_length=MAX_GRID_LIST)
    seq_len: AttentionSeqLen | None = Field(None, description=ATTENTION_SEQ_LEN_ABOUT)
    num_segments: SegmentCount = 16
    batch_size: WindowBatch = 4
    linformer_projection: LinformerProjection = DEFAULT_LINFORMER_PROJECTION
    bos_per_window: BosPerWindow = False
    seeds: int | list[Seed] = Field(3, description="number of seeds (0..seeds-1) or the seeds themselves")

    @property
    def targets(self) -> list[str]:
        return [self.target] if isinstance(self.target, str) else list(self.target)

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    @model_validator(mode="after")
    def _study_fields(self, info: ValidationInfo):
        own, other = ((SUMFORMER_FIELDS, ATTENTION_FIELDS) if self.study == "sumformer"
                      else (ATTENTION_FIELDS, SUMFORMER_FIELDS))
        # A user who sets a field of the other study made a mistake, even at its default value (it
        # would be ignored: `seeds` instead of `grid.seed`). A stored row may be an older, full dump
        # that holds the other study's defaults: those pass when the worker validates it again.
        submitted = bool(info.context and info.context.get("submitted"))
        fields = type(self).model_fields
        stray = [f for f in other if f in self.model_fields_set
                 and (submitted or getattr(self, f) != fields[f].get_default(call_default_factory=True)
                      and (f not in FORMER_DEFAULTS or getattr(self, f) != FORMER_DEFAULTS[f]))]
        if stray:
            meant = {"seeds": "grid.seed", "batch_size": "train.batch_size", "features": "grid.features",
                     "seq_len": "grid.seq_len"} if self.study == "sumformer" else {}
            hints = [f"{f} → {meant[f]}" for f in stray if f in meant]
            which = f"{stray[0]} belongs" if len(stray) == 1 else f"{', '.join(stray)} belong"
            other_study = "attention" if self.study == "sumformer" else "sumformer"
            chosen = "" if "study" in self.model_fields_set else f" (the default; set study={other_study!r} for these)"
            raise ValueError(f"{which} to the other study; study={self.study!r}{chosen} uses: "
                             f"study, {', '.join(own)}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
        if self.study == "sumformer":
            if not self.targets:
                raise ValueError("target: give at least one target")
            for t in self.targets:
                _check_target(t)
            if len(set(self.targets)) != len(self.targets) or len(set(self.architectures)) != len(self.architectures):
                raise ValueError("target and architectures must not repeat values")
            size = _sumformer_grid_size(self)
            if size > MAX_GRID_POINTS:
                raise ValueError(f"the grid has {size} points (more than {MAX_GRID_POINTS}); make it smaller")
            for arch, n, d, dp in itertools.product(self.architectures, self.grid.seq_len, self.grid.token_dim,
                                                    self.grid.latent_dim):
                _check_latent(arch, dp, d, n)
        else:
            missing = [f for f in ("model", "dataset") if getattr(self, f) is None]
            if missing:
                raise ValueError(f"study='attention' needs {' and '.join(missing)}")
            seeds = self.seed_list
            if not seeds or len(set(seeds)) != len(seeds) or len(seeds) > MAX_GRID_LIST:
                raise ValueError(f"seeds: give a count in [1, {MAX_GRID_LIST}] or at most {MAX_GRID_LIST} distinct "
                                 f"seeds, got {self.seeds}")
            if len(set(self.methods)) != len(self.methods):
                raise ValueError("methods must not repeat values")
            if len(set(self.features)) != len(self.features):
                raise ValueError(f"features must not repeat values, got {self.features}")
        return self

    def model_refs(self) -> list[str]:
        return [self.model] if self.model else []

    def dataset_refs(self) -> list[str]:
        return [self.dataset] if self.dataset else []

    def positions_read(self) -> tuple[str, int] | None:
        return ("seq_len", self.seq_len) if self.study == "attention" and self.seq_len is not None else None

    def layers_read(self) -> tuple[str, str, list[int]] | None:
        if self.study != "attention" or self.layers is None or self.model is None:
            return None
        return ("layers", self.model, self.layers)

    def softmax_attention_read(self) -> str | None:
        return self.model if self.study == "attention" else None

    def stored(self) -> dict[str, Any]:
        """Only this study's fields: a sumformer sweep does not list the attention study's defaults."""
        other = ATTENTION_FIELDS if self.study == "sumformer" else SUMFORMER_FIELDS
        return self.model_dump(mode="json", exclude=set(other))


def _sumformer_grid_size(p: SweepParams) -> int:
    g = p.grid
    per_arch = len(g.latent_dim) * len(g.token_dim) * len(g.seq_len) * len(g.seed) * len(p.targets)
    return sum(per_arch * (len(g.features) if a in USES_FEATURES else 1) for a in p.architectures)


def _fmt_latent(d: int | None) -> str:
    return "theory" if d is None else str(d)


def clamped_latent_dims(params: SweepParams) -> list[dict]:
    """The grid's poly_sumformer d′ values above C(n+d,d)−1, per (d, n): what was asked and what runs.

    [{"token_dim": d, "seq_len": n, "requested": [d′, …], "effective": C(n+d,d)−1}, …]; empty when
    nothing was clamped (or the sweep has no poly_sumformer).
    """
    if params.study != "sumformer" or "poly_sumformer" not in params.architectures:
        return []
    out = []
    for n, d in itertools.product(params.grid.seq_len, params.grid.token_dim):
        theory = theory_latent_dim(d, n)
        asked = sorted(x for x in params.grid.latent_dim if x is not None and x > theory)
        if asked:
            out.append({"token_dim": d, "seq_len": n, "requested": asked, "effective": theory})
    return out


def expand_sweep(params: SweepParams) -> list[ChildSpec]:
    """The sweep's grid points as child jobs (runs in the API at submit: pure Python, no torch).

    Sumformer: architectures × targets × seq_len × token_dim × latent_dim × features × seed, where
    features multiplies only linformer/performer. A polynomial Sumformer's d' above C(n+d,d)−1 is
    clamped to it, and grid points that become identical are created once; the child's
    `latent_dim_requested` keeps the grid's values (see also `clamped_latent_dims`).
    Attention: methods × seeds; each child covers every layer and every k. Linformer with `pooling`
    projections draws nothing at random, so it is one child (the first seed) whatever `seeds` says.
    """
    if params.study == "attention":
        def seeds_of(method: str) -> list[int]:
            deterministic = method == "linformer" and params.linformer_projection == "pooling"
            return params.seed_list[:1] if deterministic else params.seed_list

        return [
            ChildSpec(
                "attention_approx",
                AttentionApproxParams(
                    model=params.model, dataset=params.dataset, method=method, features=params.features,
                    layers=params.layers, seq_len=params.seq_len, num_segments=params.num_segments,
                    batch_size=params.batch_size, linformer_projection=params.linformer_projection,
                    bos_per_window=params.bos_per_window, seed=seed,
                ).model_dump(mode="json"),
                name=f"{method} seed={seed}",
            )
            for method in params.methods
            for seed in seeds_of(method)
        ]

    g = params.grid
    # Points are keyed by the d′ that will run, so that `null` (theory) beside an explicit d′ equal to
    # it is one child, not two that the aggregation would count as two seeds.
    # key → (the grid's d′ that the child keeps, the grid's d′ values above theory clamped into it)
    points: dict[tuple, tuple[int | None, list[int]]] = {}
    for arch, target, n, d, latent, seed in itertools.product(
        params.architectures, params.targets, g.seq_len, g.token_dim, g.latent_dim, g.seed
    ):
        clamped = []
        effective = effective_latent_dim(arch, latent, d, n)
        if arch == "poly_sumformer" and latent is not None:
            if latent > theory_latent_dim(d, n):
                clamped = [latent]
            latent = None if effective == theory_latent_dim(d, n) else effective  # None: all monomials
        for k in (g.features if arch in USES_FEATURES else [None]):
            points.setdefault((arch, target, n, d, effective, k, seed), (latent, []))[1].extend(clamped)
    children: list[ChildSpec] = []
    for (arch, target, n, d, _, k, seed), (latent, clamped) in points.items():
        child = SumformerFitParams(
            target=target, architecture=arch, latent_dim=latent, token_dim=d, seq_len=n, features=k,
            seed=seed, train=params.train, latent_dim_requested=clamped or None,
        )
        asked = f" (asked {', '.join(map(str, clamped))})" if clamped else ""
        name = (f"{arch} {target} d={d} n={n} d'={_fmt_latent(latent)}{asked}" + (f" k={k}" if k else "")
                + f" seed={seed}")
        children.append(ChildSpec("sumformer_fit", child.model_dump(mode="json"), name=name))
    return children


__all__ = [
    "TARGET_FORMULAS", "USES_FEATURES", "AttentionApproxParams", "SumformerFitParams", "SumformerGrid",
    "SweepParams", "TrainSettings", "clamped_latent_dims", "effective_latent_dim", "expand_sweep",
    "theory_latent_dim",
]
