"""Job kind `train`: train a small GPT-2- or LLaMA-style causal LM on a dataset, with resumable checkpoints.

Data. The last ``val_fraction`` of the documents (a contiguous tail) is held out; documents are what
the dataset's format makes them (paragraphs for ``lines``: WikiText's articles are not marked, so the
boundary can fall inside one). Each split becomes one token stream (documents joined with EOS)
cut into non-overlapping windows of ``context + 1`` tokens: input ``w[:-1]``, targets ``w[1:]``.
Step ``s`` reads windows ``order[s·B : (s+1)·B]`` of an endless sequence of seeded permutations,
one per epoch — the data position is a function of the step, which is what makes resume exact.

Optimisation. AdamW (β = 0.9, 0.95; weight decay on every parameter of ≥ 2 dimensions: matrices and
embeddings, not biases or norm gains), learning rate
    lr(s) = lr · (s+1)/warmup                                    for s < warmup
    lr(s) = lr · (r + (1−r)·½(1 + cos(π·(s−warmup)/(steps−warmup))))  afterwards, r = min_lr_ratio,
gradient clipping, bf16 autocast on CUDA, fp32 on CPU.

Baseline. ``unigram_entropy`` is the cross-entropy, in nats, of the validation targets under the
unigram distribution of the training stream (add-one smoothed):
    H = −(1/|val|) Σ_{t ∈ val} ln p(t),   p(t) = (count_train(t) + 1) / (N_train + V).
It is what a context-free model fitted on the training split scores on the same targets as
``loss.val``. ``unigram_val_entropy``, the entropy of those targets' own distribution, is what the
best context-free model possible scores on them: a validation loss below it proves the model uses context.

Checkpoints. At step 0 (the initialisation, so curves over training start where training did), every
``checkpoint_every`` steps and at the end, ``checkpoints/step-N/`` (written to a
temporary folder, then renamed) holds the HF model (safetensors), the tokenizer, and
``trainer_state.json`` (step, loss history, RNG state; the lr schedule is a function of the step).
The newest checkpoint also holds ``optimizer.pt`` (AdamW moments), dropped from older ones to save
space. Each is registered as model ``<run_name>@step<N>``. A new attempt of the same job continues
from the newest checkpoint; on CPU the result equals an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmscope.analyses.base import JobCancelled, JobContext, JobFailed, JobOutput, Series, eta_text, own_attention
from lmscope.analyses.plotting import pyplot, save
from lmscope.params.train import TrainParams
from lmscope.wording import byte_size

log = logging.getLogger("lmscope.train")

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
# Fields that decide the model, the tokenizer or the data: a checkpoint made with other values cannot be resumed.
SHAPE_FIELDS = ("dataset", "architecture", "layers", "width", "heads", "kv_heads", "context", "tokenizer",
                "vocab_size", "batch_size", "val_fraction", "seed")


# ---------------------------------------------------------------- pieces (each testable on its own)

def split_documents(documents: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val): val is the last ``ceil(val_fraction · n)`` documents, at least one on each side."""
    if len(documents) < 2:
        raise JobFailed(f"the dataset has {len(documents)} document(s); training needs at least 2 "
                        "(one for training, one for validation)")
    n_val = min(len(documents) - 1, max(1, math.ceil(val_fraction * len(documents))))
    return documents[:-n_val], documents[-n_val:]


def lr_at(step: int, p: TrainParams) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine to lr · min_lr_ratio."""
    if step < p.warmup_steps:
        return p.lr * (step + 1) / p.warmup_steps
    progress = (step - p.warmup_steps) / max(1, p.steps - p.warmup_steps)
    return p.lr * (p.min_lr_ratio + (1 - p.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class BatchOrder:
    """Window indices of each step: epoch e visits the windows in ``randperm(n, seed=(seed, e))`` order."""

    def __init__(self, num_windows: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = num_windows, batch_size, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            # modulo 2^63: manual_seed takes no more; seeds up to 2^63 − 1 are valid params
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}  # keep one epoch in memory
        return self._perms[epoch]

    def __call__(self, step: int) -> torch.Tensor:
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        return torch.stack([self._perm(q // self.n)[q % self.n] for q in positions])


def _entropy(counts: torch.Tensor) -> float:
    p = counts[counts > 0] / counts.sum()
    return -(p * p.log()).sum().item()


def unigram_baselines(train_stream: torch.Tensor, val_targets: torch.Tensor,
                      vocab_size: int) -> tuple[float, float, float]:
    """(cross-entropy of val targets under the add-one train unigram, entropy of the train unigram,
    entropy of the val targets' own unigram: the floor of every context-free model on them), nats."""
    counts = torch.bincount(train_stream.flatten(), minlength=vocab_size).double()
    p_smooth = (counts + 1) / (counts.sum() + vocab_size)
    cross = -p_smooth.log()[val_targets.flatten()].mean().item()
    val_counts = torch.bincount(val_targets.flatten(), minlength=vocab_size).double()
    return cross, _entropy(counts), _entropy(val_counts)


def build_model(p: TrainParams, tokenizer):
    """A fresh HF causal LM (seeded init) whose vocabulary fits ``tokenizer``; tied input/output embeddings."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    if p.architecture == "gpt2":
        config = GPT2Config(n_layer=p.layers, n_head=p.heads, n_embd=p.width, n_positions=p.context,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    else:
        ffn = 32 * math.ceil(8 * p.width / 3 / 32)  # LLaMA's 8/3·d gated MLP, rounded up to a multiple of 32
        config = LlamaConfig(hidden_size=p.width, intermediate_size=ffn, num_hidden_layers=p.layers,
                             num_attention_heads=p.heads, num_key_value_heads=p.kv_heads or p.heads,
                             max_position_embeddings=p.context, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p.seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def make_optimizer(model, p: TrainParams) -> torch.optim.AdamW:
    params = [prm for prm in model.parameters() if prm.requires_grad]
    decay = [prm for prm in params if prm.dim() >= 2]  # matrices and embeddings; not biases or norm gains
    no_decay = [prm for prm in params if prm.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": p.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=p.lr, betas=(0.9, 0.95))


def next_token_loss(model, windows: torch.Tensor, autocast) -> torch.Tensor:
    """Mean cross-entropy of ``windows[:, 1:]`` given ``windows[:, :-1]``."""
    x, y = windows[:, :-1], windows[:, 1:]
    with autocast():
        logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, val_windows: torch.Tensor, batch_size: int, autocast) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(val_windows), batch_size):
        batch = val_windows[start:start + batch_size]
        total += next_token_loss(model, batch, autocast).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def thin(points: list[list[float]], max_points: int = 5000) -> tuple[list[float], list[float]]:
    """At most ``max_points`` (x, y): block means of consecutive points, x = the block's last x."""
    stride = max(1, math.ceil(len(points) / max_points))
    xs, ys = [], []
    for i in range(0, len(points), stride):
        block = points[i:i + stride]
        xs.append(block[-1][0])
        ys.append(sum(y for _, y in block) / len(block))
    return xs, ys


# ---------------------------------------------------------------- checkpoints

def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints under ``root``, in step order."""
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit() and (d / STATE_FILE).is_file():
                found.append((int(d.name[5:]), d))
    return sorted(found)


def save_checkpoint(root: Path, step: int, model, tokenizer, optimizer, state: dict[str, Any]) -> Path:
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict()}, tmp / OPTIMIZER_FILE)
    (tmp / STATE_FILE).write_text(json.dumps(state))  # written last: its presence marks a complete checkpoint
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for _, older in checkpoint_dirs(root):  # only the newest checkpoint is needed to resume
        if older != final:
            (older / OPTIMIZER_FILE).unlink(missing_ok=True)
    return final


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ---------------------------------------------------------------- the job

CHECKPOINT_HEADROOM_BYTES = 1 << 30  # a checkpoint leaves at least this much of the disk free (or 5 %)
# A stopped run saves its last step when it writes in seconds (weights + AdamW state): the time limit leaves
# a minute at most (a twentieth of a short limit).
STOP_CHECKPOINT_BYTES = 2 << 30


def _tokenizer_for(p: TrainParams, ctx: JobContext, train_docs: list[str]):
    from lmscope.modeling.tokenization import byte_tokenizer, train_bpe_tokenizer

    if p.tokenizer == "bpe":
        return train_bpe_tokenizer(train_docs, p.vocab_size, add_bos=False)
    if p.tokenizer == "bytes":
        return byte_tokenizer(add_bos=False)
    tokenizer = ctx.load_tokenizer(p.tokenizer)  # not the model: its weights would sit on the device all run
    if tokenizer.eos_token_id is None:
        raise JobFailed(f"the tokenizer of {p.tokenizer!r} has no EOS token to separate documents; "
                        "use tokenizer 'bpe' or 'bytes'")
    return tokenizer


class TrainingRun:
    """One attempt of a train job: continue from the newest checkpoint, if any, then train, checkpoint, report.

    ``run`` calls its steps in order: ``resume``, ``load_data``, ``build``, ``train``, ``results``.
    """

    def __init__(self, p: TrainParams, ctx: JobContext):
        self.p, self.ctx = p, ctx
        self.started = time.perf_counter()
        self.run_name = p.run_name or f"run{ctx.job_id}"
        self.ckpt_root = ctx.artifact_dir / CHECKPOINTS
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        self.device = ctx.device
        use_bf16 = self.device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else nullcontext
        ctx.record("precision", "bf16 autocast" if use_bf16 else "fp32")

    def register_all(self) -> list[str]:
        names = []
        for step, path in checkpoint_dirs(self.ckpt_root):
            self.ctx.register_model(f"{self.run_name}@step{step}", path, step=step)
            names.append(f"{self.run_name}@step{step}")
        return names

    def resume(self) -> None:
        """Find the newest checkpoint an earlier attempt of this job left, check it fits, load it."""
        # Its import also turns off transformers' progress bars ("Writing model shards" at every checkpoint).
        from lmscope.modeling.loading import load_model

        for stale in self.ckpt_root.glob(".step-*.tmp"):  # half-written by an attempt that died while saving
            shutil.rmtree(stale, ignore_errors=True)
        existing = checkpoint_dirs(self.ckpt_root)
        self.resume_dir = existing[-1][1] if existing else None
        self.state: dict[str, Any] = {}
        self.resumed = None
        if self.resume_dir:
            self.state = json.loads((self.resume_dir / STATE_FILE).read_text())
            old = {k: self.state["params"].get(k) for k in SHAPE_FIELDS}
            new = {k: getattr(self.p, k) for k in SHAPE_FIELDS}
            if old != new:
                changed = [k for k in SHAPE_FIELDS if old[k] != new[k]]
                raise JobFailed(f"the checkpoints in {self.ckpt_root} were made with other {', '.join(changed)}; "
                                "submit a new job instead of retrying this one")
            self.register_all()  # an attempt may have died between saving and registering
            self.resumed = load_model(f"{self.run_name}@step{existing[-1][0]}", "checkpoint", str(self.resume_dir),
                                      device=self.device)

    def load_data(self) -> None:
        """The tokenizer, the training and validation windows, and the unigram baselines."""
        from lmscope.modeling.windows import token_windows

        p, ctx = self.p, self.ctx
        with ctx.stage("data"):
            documents = ctx.load_documents(p.dataset)
            train_docs, val_docs = split_documents(documents, p.val_fraction)
            ctx.progress(0, p.steps, "training the tokenizer" if p.tokenizer == "bpe" and not self.resume_dir
                         else "tokenizing")
            self.tokenizer = self.resumed.tokenizer if self.resumed else _tokenizer_for(p, ctx, train_docs)
            # Documents as the tokenizer encodes them, special tokens included; a run whose checkpoints
            # predate that keeps its plain stream, or its resumed data would differ from attempt 1's.
            self.special = self.state.get("stream_special_tokens", False) if self.resume_dir else True
            try:
                self.train_windows = token_windows(self.tokenizer, train_docs, p.context + 1, None,
                                                   special=self.special)
            except ValueError:
                raise JobFailed(f"the training split ({len(train_docs)} documents) holds less than one window of "
                                f"{p.context + 1} tokens; use a larger dataset or lower context") from None
            try:
                val_windows = token_windows(self.tokenizer, val_docs, p.context + 1, p.eval_batches * p.batch_size,
                                            special=self.special)
            except ValueError:
                raise JobFailed(f"the validation split ({len(val_docs)} documents) holds less than one window of "
                                f"{p.context + 1} tokens; raise val_fraction or lower context") from None
            self.vocab_size = len(self.tokenizer)
            self.unigram_cross_entropy, self.unigram_train_entropy, self.unigram_val_entropy = unigram_baselines(
                self.train_windows, val_windows[:, 1:], self.vocab_size)
        # the training windows stay on the CPU; each batch moves on its own
        self.val_windows = val_windows.to(self.device)

    def build(self) -> None:
        """The model and optimiser, fresh or as the checkpoint left them; the history so far; the clock."""
        p = self.p
        self.model = self.resumed.model if self.resumed else build_model(p, self.tokenizer).to(self.device)
        self.ctx.record("kernel_backend", own_attention(self.model))  # training needs autograd: no lmscope kernel
        self.model.train()
        self.num_parameters = sum(prm.numel() for prm in self.model.parameters())
        self.optimizer = make_optimizer(self.model, p)
        self.history: dict[str, list] = self.state.get("history", {"train": [], "val": [], "lr": []})
        self.start_step = self.step = self.state.get("step", 0)
        self.wall_before = self.state.get("train_seconds", 0.0)
        if self.resume_dir:
            # on the CPU: load_state_dict moves the moments to the parameters' device but keeps AdamW's `step`
            # where it was loaded, and a CUDA `step` costs a host sync per parameter per step
            self.optimizer.load_state_dict(
                torch.load(self.resume_dir / OPTIMIZER_FILE, map_location="cpu", weights_only=True)["optimizer"])
            _set_rng_state(self.state["rng"])
        else:
            torch.manual_seed(p.seed)
        self.order = BatchOrder(len(self.train_windows), p.batch_size, p.seed)
        if not self.history["val"]:
            self.history["val"].append([0, evaluate(self.model, self.val_windows, p.batch_size, self.autocast)])
        self.loop_start = time.perf_counter()

    def train(self) -> None:
        """Steps from where the run stands to ``steps``: evaluate, checkpoint and report on their schedules."""
        p, ctx, history = self.p, self.ctx, self.history
        report_every = max(1, min(10, p.steps // 100))  # steps the loss in the progress text averages
        report = "training"
        with ctx.stage("train"):
            # the whole run's checkpoints, before hours of training rather than at the one that does not fit
            self.check_disk_space(checkpoints=len(self.checkpoint_steps_ahead()))
            if not self.resume_dir:  # the untrained model: where curves over training start
                self.checkpoint()
            while self.step < p.steps:
                lr = lr_at(self.step, p)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                loss = next_token_loss(self.model, self.train_windows[self.order(self.step)].to(self.device),
                                       self.autocast)
                loss.backward()
                if p.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                value = loss.item()
                if not math.isfinite(value):  # the step's update made the weights NaN: it is not counted
                    raise self.diverged(f"the training loss at step {self.step + 1} is {value}")
                self.step += 1
                step = self.step
                history["train"].append([step, value])
                history["lr"].append([step, lr])

                if step % p.eval_every == 0 or step == p.steps:
                    val = evaluate(self.model, self.val_windows, p.batch_size, self.autocast)
                    if not math.isfinite(val):
                        raise self.diverged(f"the validation loss after step {step} is {val}")
                    history["val"].append([step, val])
                if step % p.checkpoint_every == 0 or step == p.steps:
                    self.checkpoint()
                if step % report_every == 0 or step == p.steps:
                    recent = [l for _, l in history["train"][-report_every:]]
                    per_step = (time.perf_counter() - self.loop_start) / (step - self.start_step)
                    report = (f"train loss {sum(recent) / len(recent):.3f} · val {history['val'][-1][1]:.3f} · "
                              f"ETA {eta_text(per_step * (p.steps - step))}")
                # every step (the worker writes a few a second at most): a cancel or the time limit stops after
                # this step, not up to 9 later, and the job's progress then says the step its summary does
                ctx.progress(step, p.steps, report)

    def train_seconds(self) -> float:
        return self.wall_before + time.perf_counter() - self.loop_start

    def checkpoint_steps_ahead(self) -> list[int]:
        """The steps still to be checkpointed: 0 (a fresh run), every checkpoint_every, and the last."""
        p = self.p
        ahead = [s for s in range(self.step + 1, p.steps + 1) if s % p.checkpoint_every == 0 or s == p.steps]
        return ([0] if not self.resume_dir and self.step == 0 else []) + ahead

    def diverged(self, what: str) -> JobFailed:
        return JobFailed(f"{what}: the run diverged; lower lr, raise warmup_steps or keep grad_clip on "
                         "(the checkpoints written before it stay registered)", error_type="diverged")

    def checkpoint(self) -> None:
        p, step = self.p, self.step
        finite = torch.stack([prm.detach().isfinite().all() for prm in self.model.parameters()]).all()
        if not bool(finite):  # a NaN gradient (clipping cannot fix one) with a still-finite loss
            raise self.diverged(f"the weights after step {step} are not finite")
        self.check_disk_space()
        trainer_state = {"step": step, "run_name": self.run_name, "params": p.model_dump(), "history": self.history,
                         "rng": _rng_state(), "tokens_seen": step * p.batch_size * p.context,
                         "stream_special_tokens": self.special,
                         "train_seconds": self.train_seconds(),
                         "lr_schedule": "warm-up + cosine, a function of the step (lmscope.analyses.train.lr_at)"}
        path = save_checkpoint(self.ckpt_root, step, self.model, self.tokenizer, self.optimizer, trainer_state)
        self.ctx.register_model(f"{self.run_name}@step{step}", path, step=step)

    def weights_bytes(self) -> int:
        # parameters(), not state_dict(): a tied embedding / LM head is one tensor, saved once
        return sum(t.numel() * t.element_size() for t in self.model.parameters())

    def check_disk_space(self, checkpoints: int = 1) -> None:
        """Refuse checkpoints the disk cannot hold (weights each, and AdamW's two moments beside the newest)
        with room to spare for everyone else (1 GiB or 5 % of the disk, the more), rather than fill the disk
        every job and user shares. At the start of the run ``checkpoints`` is all of them still to come."""
        if checkpoints < 1:
            return
        weights = self.weights_bytes()
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        disk = shutil.disk_usage(self.ckpt_root)
        spare = max(CHECKPOINT_HEADROOM_BYTES, disk.total // 20)
        needed = (checkpoints + 2) * weights + spare
        if disk.free < needed:
            what = (f"the checkpoint at step {self.step} needs" if checkpoints == 1 else
                    f"the run's {checkpoints} checkpoints still to write need")
            raise JobFailed(f"{what} about {byte_size(needed)} (weights {byte_size(weights)} each, AdamW state twice "
                            f"that, and {byte_size(spare)} left free for others) and the artifact store has "
                            f"{byte_size(disk.free)} free; train a smaller model (width, layers), write fewer "
                            "checkpoints (checkpoint_every) or free disk space", error_type="disk-full")

    def stop_checkpoint(self) -> None:
        """A run stopped early (cancel, time limit) saves the step it reached, so that the weights of the steps
        since the last checkpoint are not lost — unless it is already saved, or too large to write quickly
        (weights and AdamW's two moments: 3× the weights)."""
        if self.step in {s for s, _ in checkpoint_dirs(self.ckpt_root)} or \
                3 * self.weights_bytes() > STOP_CHECKPOINT_BYTES:
            return
        try:
            self.checkpoint()
        except Exception as e:  # noqa: BLE001 - no room, diverged, a write error: the stop and its results go on
            log.warning("job %s: the checkpoint at the step the run stopped at (%d) was not written: %s",
                        self.ctx.job_id, self.step, e)
            shutil.rmtree(self.ckpt_root / f".step-{self.step}.tmp", ignore_errors=True)

    def results(self, stopped: str | None = None) -> JobOutput:
        """The run's results; `stopped` says why a partial run ended early ("cancelled", …)."""
        p, step, history = self.p, self.step, self.history
        checkpoint_names = self.register_all()
        train_seconds = self.train_seconds()
        _plot(self.ctx.artifact_dir / "loss.png", self.run_name, p, history, self.unigram_cross_entropy,
              [s for s, _ in checkpoint_dirs(self.ckpt_root)], stopped=(stopped, step) if stopped else None)
        tail = [l for _, l in history["train"][-20:]]
        train_x, train_y = thin(history["train"])
        unigram = self.unigram_cross_entropy
        series = [
            Series("loss.train", train_x, train_y),
            Series("loss.val", [s for s, _ in history["val"]], [l for _, l in history["val"]]),
            Series("lr", *thin(history["lr"])),
            Series("unigram_entropy", [0, step], [unigram, unigram],
                   {"definition": "val cross-entropy under the add-one train unigram, nats"}),
        ]
        summary = {
            "run_name": self.run_name,
            "train_loss": sum(tail) / len(tail) if tail else None,  # mean of the last 20 steps
            "val_loss": history["val"][-1][1],
            "val_loss_step": history["val"][-1][0],
            "unigram_entropy": unigram,
            "unigram_train_entropy": self.unigram_train_entropy,
            "unigram_val_entropy": self.unigram_val_entropy,
            "steps": step,
            "tokens_seen": step * p.batch_size * p.context,
            "epochs": step * p.batch_size / len(self.train_windows),
            "train_tokens": int(self.train_windows.numel()),
            "val_tokens": int(self.val_windows[:, 1:].numel()),
            "vocab_size": self.vocab_size,
            "num_parameters": self.num_parameters,
            "checkpoints": checkpoint_names,
            "resumed_from_step": self.start_step if self.resume_dir else None,
            "train_seconds": round(train_seconds, 2),
            "wall_seconds": round(time.perf_counter() - self.started, 2),
        }
        first_val, last_val = history["val"][0][1], history["val"][-1][1]
        if len(history["val"]) > 1 and last_val > first_val:
            summary["warning"] = (f"the validation loss rose from {first_val:.4g} at step 0 to {last_val:.4g} at step "
                                  f"{history['val'][-1][0]}: the run diverged; lower lr or raise warmup_steps")
        if stopped:
            summary.update(partial=True, steps_planned=p.steps,
                           note=f"{stopped} after step {step} of {p.steps}: the numbers and curves stop there, "
                                "and the checkpoints written until then stay registered")
        return JobOutput(summary=summary, series=series)


def run(params: TrainParams, ctx: JobContext) -> JobOutput:
    training = TrainingRun(params, ctx)
    training.resume()
    training.load_data()
    training.build()
    try:
        training.train()
    except JobCancelled:
        if training.step >= params.steps:  # the cancel came with the last step: the run is complete
            return training.results()
        # What was trained stays usable: its checkpoints are registered, its loss curve and numbers kept.
        training.stop_checkpoint()
        raise JobCancelled(partial=training.results("cancelled")) from None
    except JobFailed as e:
        if e.error_type not in ("time-limit", "disk-full", "diverged") or (e.error_type == "disk-full" and training.step == 0):
            raise
        if e.error_type == "time-limit" and training.step >= params.steps:  # the limit came with the last step
            return training.results()
        if e.error_type == "time-limit":
            training.stop_checkpoint()
        # The job fails, but like a cancelled run it keeps what it trained.
        why = {"time-limit": "stopped by the time limit", "disk-full": "stopped: no disk space for a checkpoint",
               "diverged": "stopped: the loss diverged"}[e.error_type]
        raise JobFailed(str(e), error_type=e.error_type, partial=training.results(why)) from None
    return training.results()


def _plot(path: Path, run_name: str, p: TrainParams, history: dict[str, list], baseline: float,
          checkpoint_steps: list[int], stopped: tuple[str, int] | None = None) -> None:
    fig, (ax, ax_lr) = pyplot().subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps = [s for s, _ in history["train"]]
    losses = [l for _, l in history["train"]]
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (each step)")
    # The trend through batch noise: a centred running median, so one spiky batch neither lifts the
    # line for the next steps nor makes it drop when it leaves the window (a trailing mean did both).
    # Its window grows with the run (a two-hundredth of it, at least 21 steps), so long runs read smooth too.
    half = max(10, len(losses) // 400)
    at = range(0, len(losses), max(1, len(losses) // 2000))  # a line of ~2000 points: the medians cost n²/200 else
    # At the start the window shrinks symmetrically, so the line starts at the first loss, not at a later
    # median; at the end it is cut off instead (a symmetric shrink ended the line on one batch's loss,
    # which read as the loss turning up at the last step).
    smooth = [statistics.median(losses[max(0, i - half):i + min(half, i) + 1]) for i in at]
    ax.plot([steps[i] for i in at], smooth, color="tab:blue", label=f"train (running median of {2 * half + 1} steps)")
    val = history["val"]
    ax.plot([s for s, _ in val], [l for _, l in val], "o-" if len(val) <= 40 else "-", color="tab:orange", ms=3,
            label="validation")
    ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline {baseline:.2f}")
    few_checkpoints = len(checkpoint_steps) <= 20
    if few_checkpoints:
        for s in checkpoint_steps:
            ax.axvline(s, color="lightgray", ls=":", lw=0.8)
    else:  # a line each would grey the panel out: ticks along its top instead
        ax.plot(checkpoint_steps, [1.0] * len(checkpoint_steps), "|", color="gray", ms=6,
                transform=ax.get_xaxis_transform(), clip_on=False)
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter

    marked = sorted(set(checkpoint_steps))
    span = max(steps[-1] if steps else 1, marked[-1] if marked else 1, 1)
    if 2 <= len(marked) <= 12 and min(b - a for a, b in zip(marked, marked[1:])) >= span / 12:
        ax.set_xticks(marked)  # the steps a reader looks up (the models step<N>), the last among them
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 2.5 on a short run's axis
    # 5, 6, 7 rather than 5×10⁰; minor ticks are labelled only within one decade, where they are the only
    # labels (over several, 2 … 9 of each decade would overlap)
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    lo, hi = ax.get_ylim()
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g") if hi / lo < 10 else NullFormatter())
    ax.set_ylabel("next-token loss (nats, log scale)")
    marks = "dotted lines" if few_checkpoints else "ticks along the top"
    ax.set_title(f"{run_name}: {p.architecture} {p.layers}×{p.width}, {p.heads} heads, context {p.context}, "
                 f"on {p.dataset} ({marks}: {len(checkpoint_steps)} checkpoints)"
                 + (f"\n{stopped[0]} at step {stopped[1]} of {p.steps}" if stopped else ""), fontsize=9)
    ax.legend()
    ax_lr.plot([s for s, _ in history["lr"]], [v for _, v in history["lr"]], color="tab:green")
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    save(fig, path)
