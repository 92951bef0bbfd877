"""One grid point of a Sumformer sweep (`sumformer_fit`, a child of `sweep`; Alberti et al., "Sumformer", 2023).

Train one network (poly / MLP Sumformer, one-attention-layer Transformer / Linformer / Performer,
`lmscope.modeling.sumformer`) on one equivariant target (`lmscope.analyses.targets`) and report the
relative L2 validation error

    err = ‖f(X) − g(X)‖₂ / ‖g(X)‖₂   over every sample, token and coordinate of the validation split

every `eval_every` epochs (`val_error`, x = epoch) and the training MSE (`train_loss`); `training.png`.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lmscope.analyses.base import JobContext, JobFailed, JobOutput, Series, eta_text
from lmscope.analyses.plotting import pyplot, readable_log_y, save
from lmscope.params.sweep import SumformerFitParams, effective_latent_dim, theory_latent_dim
from lmscope.seeds import derived_seed


def relative_l2_error(pred: torch.Tensor, target: torch.Tensor) -> float:
    """‖pred − target‖₂ / ‖target‖₂ over all entries, in float64."""
    pred, target = pred.double(), target.double()
    return float((pred - target).norm() / target.norm())


def make_dataset(params: SumformerFitParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_val, y_val): `samples` sequences uniform on [0,1]^(n×d) from the seed.

    The target is evaluated in float64 (fig2_poly reaches ~10²·n³) and stored as float32.
    """
    from lmscope.analyses.targets import evaluate_target, sample_inputs

    t = params.train
    x = sample_inputs(t.samples, params.seq_len, params.token_dim, params.seed, dtype=torch.float64)
    y = evaluate_target(params.target, x)
    n_val = t.val_samples
    n_train = t.samples - n_val
    x, y = x.float(), y.float()
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


@torch.no_grad()
def _predict(model, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
    return torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])


def random_permutations(count: int, n: int, seed: int) -> torch.Tensor:
    """[count, n]: a uniformly random permutation of 0 … n−1 per row, from `seed`."""
    return torch.rand(count, n, generator=torch.Generator().manual_seed(seed)).argsort(dim=1)


def equivariance_error(model, x: torch.Tensor, perm: torch.Tensor) -> float:
    """‖S(πX) − π S(X)‖₂ / ‖S(X)‖₂ over the sequences x [B, n, d], π = perm [B, n] (πX)_i = x_π(i).
    0 up to rounding for a permutation-equivariant network."""
    perm = perm.to(x.device)

    def permuted(t):
        return t.gather(1, perm[..., None].expand_as(t))

    return relative_l2_error(_predict(model, permuted(x)), permuted(_predict(model, x)))


@contextlib.contextmanager
def _single_threaded(ctx: JobContext):
    """Train with one intra-op thread on a CPU, when this process runs one job at a time.

    These networks are tiny: on a CPU, intra-op threads only fight each other (measured 10-40x slower
    with 2 threads on a loaded 2-core machine). The thread count is process-wide, so it is left alone
    when other jobs may run in this process (`ctx.shares_process`: it would throttle them), and it is
    changed only when it is > 1; the count found on entry is restored on exit.
    """
    before = torch.get_num_threads()
    apply = torch.device(ctx.device).type == "cpu" and not ctx.shares_process and before > 1
    if apply:
        torch.set_num_threads(1)
        ctx.record("torch_threads", 1)  # what trained, not the count restored afterwards
    try:
        yield
    finally:
        if apply:
            torch.set_num_threads(before)


class TrainingSteps:
    """Adam steps on batches x[idx], y[idx] (MSE), with the loss × batch size summed on the device.

    These networks are tiny: a step is ~100 kernels of microseconds each, so on a GPU the launches,
    not the arithmetic, set the time (docs/analyses/sweep.md). With `cuda_graph`, the step of a full
    batch is captured once in a CUDA graph and then replayed, one launch per step. The first steps run
    eagerly on a side stream, as capture needs (they are ordinary steps of the first epoch, not extra
    ones), and so does a last, shorter batch. Replayed and eager steps update the same tensors with the
    same kernels, so the training is the one the eager route would do; `route` says which ran.
    """

    WARMUP_STEPS = 3
    _capturing = threading.Lock()  # one capture at a time per process (an embedded worker runs jobs in threads)

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, batch_size: int,
                 cuda_graph: bool = False):
        self.model, self.x, self.y, self.batch_size = model, x, y, batch_size
        self.cuda_graph = cuda_graph and x.is_cuda
        # fused: one kernel per step for all parameters instead of several per tensor (the per-tensor
        # overhead was a third of a step on a CPU); it keeps Adam's step count on the device, which a graph
        # needs (capturable=True says so for the optimiser's own checks)
        self.opt = torch.optim.Adam(model.parameters(), lr=lr, fused=x.device.type in ("cpu", "cuda"),
                                    capturable=self.cuda_graph)
        # read once per epoch: a read per step would make a GPU wait for every step before queueing the next
        self.loss_sum = torch.zeros((), device=x.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_steps = 0
        self.not_captured: str | None = None  # why the step stays eager
        if self.cuda_graph:
            self.idx = torch.zeros(batch_size, dtype=torch.long, device=x.device)  # the graph's input
            self.side = torch.cuda.Stream(x.device)

    def _step(self, idx: torch.Tensor) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x[idx]), self.y[idx])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.loss_sum += loss.detach() * len(idx)

    def step(self, idx: torch.Tensor) -> None:
        """One optimiser step on the batch `idx` (indices into x and y, on their device)."""
        if self.graph is not None and len(idx) == self.batch_size:
            self.idx.copy_(idx)
            self.graph.replay()
            return
        if not self.cuda_graph or self.not_captured is not None or len(idx) != self.batch_size:
            self._step(idx)
            return
        from lmscope.analyses.host_reads import HostReads  # a private torch API: only where a GPU step may be captured

        current = torch.cuda.current_stream(self.x.device)
        self.side.wait_stream(current)
        last = self.eager_steps + 1 == self.WARMUP_STEPS
        with torch.cuda.stream(self.side), (HostReads() if last else contextlib.nullcontext()) as reads:
            self._step(idx)
        current.wait_stream(self.side)
        self.eager_steps += 1
        if last and reads.ops:  # look before capturing: a failed capture leaves the allocator half-way
            self.not_captured = f"the step reads values back to the host ({', '.join(sorted(set(reads.ops)))})"
        elif last:
            self._capture()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)  # the graph's backward then writes the gradients, not adds to them
        stream = torch.cuda.current_stream(self.x.device)
        try:
            # on the warm-up's stream; thread_local: another job's thread may use CUDA meanwhile
            with self._capturing, torch.cuda.graph(graph, stream=self.side, capture_error_mode="thread_local"):
                self._step(self.idx)
        except RuntimeError as e:  # an op that cannot be captured: keep training eagerly
            torch.cuda.set_stream(stream)  # the failed capture's exit leaves its stream current
            cause = e.__context__ or e  # capture_end's "invalidated" error hides the op's own
            self.not_captured = f"CUDA graph capture failed: {type(cause).__name__}: {cause}"[:300]
            return
        self.graph = graph

    @property
    def route(self) -> str:
        """cuda_graph, eager, or eager with the reason a GPU step was not captured."""
        if self.graph is not None:
            return "cuda_graph"
        return f"eager ({self.not_captured})" if self.not_captured else "eager"

    def take_loss_sum(self) -> float:
        """The summed loss × batch size since the last call (reads the device once), and reset it."""
        total = float(self.loss_sum)
        self.loss_sum.zero_()
        return total


def run_sumformer_fit(params: SumformerFitParams, ctx: JobContext, *, cuda_graph: bool | None = None) -> JobOutput:
    """Train one grid point; report `val_error` and `train_loss` per epoch and write `training.png`.

    `cuda_graph`: replay each full batch's step from a CUDA graph (`TrainingSteps`); None = on a GPU.
    """
    from lmscope.modeling.sumformer import build_network, num_parameters

    t = params.train
    device = torch.device(ctx.device)
    theory = theory_latent_dim(params.token_dim, params.seq_len)
    d_eff = effective_latent_dim(params.architecture, params.latent_dim, params.token_dim, params.seq_len)

    with ctx.stage("data"):
        x_train, y_train, x_val, y_val = (a.to(device) for a in make_dataset(params))
        # Train on standardised targets (Adam's lr then means the same for every target); the
        # error is measured on the original scale.
        mu, sigma = y_train.mean(), y_train.std().clamp_min(1e-12)
        y_train_std = (y_train - mu) / sigma

    model = build_network(params.architecture, token_dim=params.token_dim, seq_len=params.seq_len,
                          latent_dim=d_eff, hidden=t.hidden, depth=t.depth, features=params.features,
                          seed=params.seed, qk_init_std=t.qk_init_std,
                          linformer_projections=t.linformer_projections).to(device)
    if params.architecture in ("transformer", "linformer", "performer"):
        ctx.record("kernel_backend", "reference")  # training needs autograd: the PyTorch reference kernels
    steps = TrainingSteps(model, x_train, y_train_std, lr=t.lr, batch_size=t.batch_size,
                          cuda_graph=device.type == "cuda" if cuda_graph is None else cuda_graph)
    shuffle = torch.Generator().manual_seed(derived_seed(params.seed, "shuffle"))

    epochs_x: list[int] = []
    losses: list[float] = []
    eval_x: list[int] = []
    val_errors: list[float] = []
    start = time.perf_counter()
    with ctx.stage("train"), _single_threaded(ctx):
        for epoch in range(1, t.epochs + 1):
            model.train()
            perm = torch.randperm(len(x_train), generator=shuffle).to(device)
            for i in range(0, len(perm), t.batch_size):
                steps.step(perm[i:i + t.batch_size])
            train_mse = steps.take_loss_sum() / len(perm) * float(sigma) ** 2  # back to the target's units
            if not math.isfinite(train_mse):
                raise JobFailed(f"training diverged at epoch {epoch} (loss {train_mse}); lower train.lr "
                                f"(now {t.lr})", error_type="diverged")
            epochs_x.append(epoch)
            losses.append(train_mse)
            if epoch % t.eval_every == 0 or epoch == t.epochs:
                model.eval()
                err = relative_l2_error(_predict(model, x_val) * sigma + mu, y_val)
                eval_x.append(epoch)
                val_errors.append(err)
            stage = f"epoch {epoch}/{t.epochs}" + (f", val error {val_errors[-1]:.3g}" if val_errors else "")
            if epoch < t.epochs:  # as train's progress says it
                stage += f", ETA {eta_text((time.perf_counter() - start) / epoch * (t.epochs - epoch))}"
            ctx.progress(epoch, t.epochs, stage)
    seconds = time.perf_counter() - start
    ctx.record("training_steps", steps.route)
    model.eval()
    # The validation data are exchangeable, so the error cannot show a network that is not equivariant
    # (a trained Linformer's E, F weight positions differently): measure it, on the final network.
    perm = random_permutations(len(x_val), params.seq_len, derived_seed(params.seed, "equivariance"))
    equivariance = equivariance_error(model, x_val, perm)

    best = min(range(len(val_errors)), key=val_errors.__getitem__)
    summary: dict[str, Any] = {
        "architecture": params.architecture,
        "target": params.target,
        "token_dim": params.token_dim,
        "seq_len": params.seq_len,
        "features": params.features,
        "seed": params.seed,
        "latent_dim": params.latent_dim,
        "latent_dim_effective": d_eff,
        "theory_latent_dim": theory,
        "best_val_error": val_errors[best],
        "best_epoch": eval_x[best],
        "final_val_error": val_errors[-1],
        "final_train_loss": losses[-1],
        "equivariance_error": equivariance,
        "num_parameters": num_parameters(model),
        "train_samples": len(x_train),
        "val_samples": len(x_val),
        "train_seconds": round(seconds, 3),
    }
    if params.architecture == "poly_sumformer" and d_eff < theory:
        summary["note"] = (f"latent_dim {params.latent_dim} < C(n+d,d)-1 = {theory}: φ keeps the first {d_eff} "
                           "monomials in graded order (a truncated power-sum embedding)")
    asked = list(params.latent_dim_requested or [])
    if params.architecture == "poly_sumformer" and params.latent_dim is not None and params.latent_dim > theory:
        asked.append(params.latent_dim)  # a child submitted with a d′ above the theory (not via a sweep)
    if params.architecture == "poly_sumformer" and asked:
        summary["latent_dim_requested"] = asked
        summary["note"] = (f"latent_dim {', '.join(map(str, asked))} > C(n+d,d)-1 = {theory}: clamped to {theory} "
                           "(φ has only that many monomials; all of them are used)")
    labels = {"architecture": params.architecture, "target": params.target, "token_dim": params.token_dim,
              "seq_len": params.seq_len, "latent_dim": d_eff, "features": params.features, "seed": params.seed}
    series = [Series("val_error", eval_x, val_errors, labels), Series("train_loss", epochs_x, losses, labels)]
    _plot_training(ctx.artifact_dir, params, eval_x, val_errors, epochs_x, losses, d_eff)
    return JobOutput(summary, series)


def _plot_training(folder: Path, p: SumformerFitParams, ex, errs, lx, losses, d_eff) -> None:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
    a1.semilogy(ex, errs, marker="o", ms=3)
    a1.set(xlabel="epoch", ylabel="relative L2 validation error", title="validation error")
    a2.semilogy(lx, losses, color="tab:orange")
    a2.set(xlabel="epoch", ylabel="training MSE (target units)", title="training loss (mean over each epoch)")
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
        readable_log_y(a)  # an error that falls less than a decade got two labels, its plateau none
    k = f", k={p.features}" if p.features else ""
    fig.suptitle(f"{p.architecture} on {p.target}: d={p.token_dim}, n={p.seq_len}, d'={d_eff}{k}, seed {p.seed}")
    save(fig, Path(folder) / "training.png")


__all__ = ["TrainingSteps", "equivariance_error", "make_dataset", "random_permutations", "relative_l2_error", "run_sumformer_fit"]
