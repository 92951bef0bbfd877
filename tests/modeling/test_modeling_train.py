"""The `train` job kind: it learns, its checkpoints are real models, and crashes and cancels lose nothing."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from lmscope.analyses.base import JobCancelled, JobFailed
from lmscope.analyses.local import LocalContext
from lmscope.analyses.train import BatchOrder, evaluate, lr_at, make_optimizer, run
from lmscope.modeling.loading import load_model
from lmscope.params import validate_params
from lmscope.params.train import TrainParams

# Bytes learn fast: 150 steps of a 2-layer model beat the unigram baseline by ~0.2 nats.
SMALL = dict(dataset="wiki", tokenizer="bytes", layers=2, width=64, heads=2, context=32, steps=150, batch_size=16,
             lr=3e-3, warmup_steps=10, checkpoint_every=50, eval_every=25, eval_batches=4, run_name="small")
NUM_DOCS = 400


@pytest.fixture(scope="module")
def docs(wikitext_docs):
    return wikitext_docs[:NUM_DOCS]


@pytest.fixture(scope="module")
def reference(docs, tmp_path_factory):
    """One uninterrupted run that several tests read."""
    ctx = LocalContext(tmp_path_factory.mktemp("reference"), datasets={"wiki": docs}, job_id=1)
    return ctx, run(TrainParams(**SMALL), ctx)


def _series(output, name):
    return next(s for s in output.series if s.name == name)


def _val_windows(docs):
    """Independent re-derivation of the validation windows: last 5% of documents, bytes joined by EOS=257."""
    n_val = math.ceil(0.05 * len(docs))
    train, val = docs[:-n_val], docs[-n_val:]

    def stream(ds):
        out = []
        for i, d in enumerate(ds):
            out += ([257] if i else []) + list(d.encode())
        return out

    w = SMALL["context"] + 1
    tr, va = stream(train), stream(val)
    tr = tr[: len(tr) // w * w]
    va = va[: min(len(va) // w, SMALL["eval_batches"] * SMALL["batch_size"]) * w]
    return tr, torch.tensor(va).view(-1, w)


def test_validation_loss_falls_below_the_unigram_entropy(reference, docs):
    ctx, out = reference
    s = out.summary
    assert ctx.environment["kernel_backend"] == "transformers-sdpa"  # what trained it, on any device
    train_stream, val_windows = _val_windows(docs)
    # The baseline, recomputed in float64 by counting: val targets under the add-one train unigram.
    counts, total = Counter(train_stream), len(train_stream)
    targets = val_windows[:, 1:].flatten().tolist()
    baseline = -sum(math.log((counts[t] + 1) / (total + 259)) for t in targets) / len(targets)
    assert s["unigram_entropy"] == pytest.approx(baseline, rel=1e-9)
    # the floor of every context-free model on these targets: their own empirical distribution
    own = Counter(targets)
    floor = -sum(c / len(targets) * math.log(c / len(targets)) for c in own.values())
    assert s["unigram_val_entropy"] == pytest.approx(floor, rel=1e-9)
    assert s["unigram_val_entropy"] < s["unigram_entropy"]
    assert _series(out, "unigram_entropy").y == [s["unigram_entropy"]] * 2
    # the training stream's own unigram entropy (no smoothing)
    train_entropy = -sum(c / total * math.log(c / total) for c in counts.values())
    assert s["unigram_train_entropy"] == pytest.approx(train_entropy, rel=1e-9)

    val = _series(out, "loss.val")
    assert val.x == [0, 25, 50, 75, 100, 125, 150]
    assert val.y[0] == pytest.approx(math.log(259), abs=0.3)  # random init ≈ uniform over the vocabulary
    assert s["val_loss"] == val.y[-1] < s["unigram_entropy"] - 0.05
    assert _series(out, "loss.train").x == list(range(1, 151))
    assert s["train_loss"] == pytest.approx(sum(_series(out, "loss.train").y[-20:]) / 20)  # the last 20 steps
    assert s["tokens_seen"] == 150 * 16 * 32 and s["steps"] == 150

    # The final checkpoint is the model that scored that: reload it and score the val windows with HF's own loss.
    lm = load_model("small@step150", "checkpoint", str(ctx.registered["small@step150"][0]))
    with torch.no_grad():
        logits = lm.model(input_ids=val_windows[:, :-1]).logits.double()
    ours = torch.nn.functional.cross_entropy(logits.reshape(-1, 259), val_windows[:, 1:].reshape(-1))
    assert ours.item() == pytest.approx(s["val_loss"], abs=1e-4)
    assert (ctx.artifact_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_checkpoints_are_registered_models_with_tokenizer_and_resume_state(reference):
    ctx, out = reference
    assert list(ctx.registered) == ["small@step0", "small@step50", "small@step100", "small@step150"]
    assert out.summary["checkpoints"] == list(ctx.registered)
    for name, (path, step) in ctx.registered.items():
        assert path.name == f"step-{step}" and path.parent == ctx.artifact_dir / "checkpoints"
        assert (path / "trainer_state.json").is_file() and (path / "model.safetensors").is_file()
        saved = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        assert saved.eos_token_id == 257
        # training never showed the model <bos> (documents are joined by <eos>), so its tokenizer adds
        # none: norms, probe and entropy then feed the checkpoint what it was trained on
        assert saved("ab")["input_ids"] == [97, 98]
        # only the newest keeps the optimizer state (resume needs no other)
        assert (path / "optimizer.pt").is_file() == (step == 150)
    early = load_model("small@step50", "checkpoint", str(ctx.registered["small@step50"][0]))
    assert early.info["num_layers"] == 2 and early.info["num_parameters"] == out.summary["num_parameters"]


def test_step_0_is_the_untrained_model(reference, docs):
    """Curves over training (entropy with train_job) start at the initialisation: step 0 is the model
    that scored the first validation point, before any update."""
    ctx, out = reference
    _, val_windows = _val_windows(docs)
    untrained = load_model("small@step0", "checkpoint", str(ctx.registered["small@step0"][0]))
    with torch.no_grad():
        logits = untrained.model(input_ids=val_windows[:, :-1]).logits.double()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 259), val_windows[:, 1:].reshape(-1))
    val = _series(out, "loss.val")
    assert val.x[0] == 0 and loss.item() == pytest.approx(val.y[0], abs=1e-4)
    assert loss.item() > val.y[-1] + 0.5  # and not a trained one


def test_step_1s_loss_is_the_untrained_models_on_the_first_batch(reference, docs):
    """loss.train at step 1: the cross-entropy of the step-0 model on the windows BatchOrder gives step 0,
    recomputed in float64 from the training stream; `epochs` is the windows seen over those there are."""
    ctx, out = reference
    train_stream, _ = _val_windows(docs)
    w = SMALL["context"] + 1
    windows = torch.tensor(train_stream).view(-1, w)
    batch = windows[BatchOrder(len(windows), SMALL["batch_size"], 0)(0)]
    untrained = load_model("small@step0", "checkpoint", str(ctx.registered["small@step0"][0]))
    with torch.no_grad():
        logits = untrained.model(input_ids=batch[:, :-1]).logits.double()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 259), batch[:, 1:].reshape(-1))
    train = _series(out, "loss.train")
    assert train.x[0] == 1 and train.y[0] == pytest.approx(loss.item(), abs=1e-4)
    assert out.summary["epochs"] == pytest.approx(SMALL["steps"] * SMALL["batch_size"] / len(windows), rel=1e-6)


def test_lr_schedule_warmup_then_cosine():
    p = TrainParams(dataset="d", steps=110, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, p) == pytest.approx(1e-4) and lr_at(9, p) == pytest.approx(1e-3)
    assert lr_at(10, p) == pytest.approx(1e-3)
    assert lr_at(60, p) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way down the cosine
    assert lr_at(110, p) == pytest.approx(1e-4)


class FailingContext(LocalContext):
    """A worker on which `error` is raised once training reports step `at`: a crash (an exception, not a
    cancel), or the time limit, which the worker raises at a progress report."""

    def __init__(self, *args, at: int, error: Exception, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.error = at, error

    def progress(self, done, total, stage=None):
        super().progress(done, total, stage)
        if done >= self.at:
            raise self.error


@pytest.mark.parametrize("crash_at, resumed_from", [(70, 50), (20, 0)])
def test_a_crashed_run_resumes_from_its_checkpoint_and_ends_like_an_uninterrupted_one(reference, docs, tmp_path,
                                                                                      crash_at, resumed_from):
    ref_ctx, ref = reference
    with pytest.raises(RuntimeError, match="worker lost"):
        run(TrainParams(**SMALL), FailingContext(tmp_path, datasets={"wiki": docs}, job_id=1, at=crash_at,
                                                 error=RuntimeError("worker lost")))
    assert sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").iterdir()) == list(range(0, crash_at, 50))

    second = LocalContext(tmp_path, datasets={"wiki": docs}, job_id=1, attempt=2)
    out = run(TrainParams(**SMALL), second)
    assert out.summary["resumed_from_step"] == resumed_from
    trained_steps = [done for done, _, stage in second.progress_log if stage.startswith("train loss")]
    assert trained_steps[0] == resumed_from + 1 and trained_steps[-1] == 150  # steps before were not trained again
    # Same data order, optimizer moments and weights: the curves and the final weights are those of the uninterrupted run.
    assert _series(out, "loss.train").y == _series(ref, "loss.train").y
    assert _series(out, "loss.val").y == _series(ref, "loss.val").y
    final = load_model("a", "checkpoint", str(second.registered["small@step150"][0])).model
    expected = load_model("b", "checkpoint", str(ref_ctx.registered["small@step150"][0])).model
    for got, want in zip(final.parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert list(second.registered) == ["small@step0", "small@step50", "small@step100", "small@step150"]


def test_a_run_checkpointed_before_the_bos_change_resumes_on_its_old_stream(reference, docs, tmp_path):
    """Checkpoints written before train's tokenizers stopped adding <bos> hold one that adds it, and their
    stream had no special tokens: a resumed attempt must read the same stream, not a <bos>-laden one."""

    from lmscope.modeling.tokenization import byte_tokenizer

    ref_ctx, ref = reference
    with pytest.raises(RuntimeError, match="worker lost"):
        run(TrainParams(**SMALL), FailingContext(tmp_path, datasets={"wiki": docs}, job_id=1, at=70,
                                                 error=RuntimeError("worker lost")))
    old = tmp_path / "checkpoints" / "step-50"
    byte_tokenizer().save_pretrained(old)  # the old tokenizer: <bos> in front of every text
    state = json.loads((old / "trainer_state.json").read_text())
    assert state.pop("stream_special_tokens") is True
    (old / "trainer_state.json").write_text(json.dumps(state))

    out = run(TrainParams(**SMALL), LocalContext(tmp_path, datasets={"wiki": docs}, job_id=1, attempt=2))
    assert out.summary["resumed_from_step"] == 50
    assert out.summary["train_tokens"] == ref.summary["train_tokens"]
    assert _series(out, "loss.train").y == _series(ref, "loss.train").y


def test_cancel_keeps_the_checkpoints_and_the_curves_so_far(reference, docs, tmp_path):
    # Progress is reported once before training and then every step: the 60th report is step 59.
    ctx = LocalContext(tmp_path, datasets={"wiki": docs}, job_id=3, cancel_after=60)
    with pytest.raises(JobCancelled) as cancelled:
        run(TrainParams(**{**SMALL, "run_name": None}), ctx)
    assert ctx.progress_log[-1][0] == 59
    # the step it stopped at is saved too: the 9 steps since step 50 are not lost
    assert list(ctx.registered) == ["run3@step0", "run3@step50", "run3@step59"]
    lm = load_model("run3@step59", "checkpoint", str(ctx.registered["run3@step59"][0]))
    assert lm.info["architecture"] == "gpt2"
    state = json.loads((ctx.registered["run3@step59"][0] / "trainer_state.json").read_text())
    assert state["step"] == 59 and len(state["history"]["train"]) == 59

    # What the worker stores with the cancelled status: the run up to step 59, the same numbers the
    # uninterrupted reference run had at those steps (CPU training is deterministic).
    partial = cancelled.value.partial
    summary = partial.summary
    assert summary["partial"] is True and summary["steps"] == 59 and summary["steps_planned"] == SMALL["steps"]
    assert summary["checkpoints"] == ["run3@step0", "run3@step50", "run3@step59"]
    assert "cancelled after step 59" in summary["note"]
    assert summary["tokens_seen"] == 59 * SMALL["batch_size"] * SMALL["context"]
    ref_train, ref_val = _series(reference[1], "loss.train"), _series(reference[1], "loss.val")
    train, val = _series(partial, "loss.train"), _series(partial, "loss.val")
    assert list(train.x) == list(range(1, 60))
    assert train.y == pytest.approx(list(ref_train.y[:59]), rel=1e-5)
    assert list(val.x) == [0, 25, 50] and val.y == pytest.approx(list(ref_val.y[:3]), rel=1e-5)
    assert summary["val_loss"] == pytest.approx(ref_val.y[2], rel=1e-5) and summary["val_loss_step"] == 50
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


class CancelledFromOutside(LocalContext):
    """A cancel that arrives from outside (the API) and is seen at the `at`-th check, whether that check is
    a progress report or not."""

    def __init__(self, *args, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.checks = at, 0

    def check_cancelled(self):
        self.checks += 1
        if self.checks >= self.at:
            raise JobCancelled()


def test_a_cancelled_runs_progress_says_the_step_its_summary_does(docs, tmp_path):
    # 200 steps: the progress text averages the loss over 2 steps; a cancel seen at an odd step (71: the
    # first check is the report before training) is no step of such a text. The job's page used to say
    # "70/200" beside a summary of 71 steps.
    ctx = CancelledFromOutside(tmp_path, datasets={"wiki": docs}, job_id=4, at=72)
    with pytest.raises(JobCancelled) as cancelled:
        run(TrainParams(**{**SMALL, "steps": 200, "checkpoint_every": 100, "run_name": None}), ctx)
    steps = cancelled.value.partial.summary["steps"]
    assert steps == 71 and ctx.progress_log[-1][:2] == (steps, 200)
    assert ctx.progress_log[-1][2].startswith("train loss")  # the last report's text, not a bare number


def test_a_run_stopped_by_the_time_limit_fails_but_keeps_its_curves(reference, docs, tmp_path):
    def time_limit():
        return JobFailed("the job ran past its time limit", error_type="time-limit")

    ctx = FailingContext(tmp_path, datasets={"wiki": docs}, job_id=5, at=59, error=time_limit())
    with pytest.raises(JobFailed, match="time limit") as failed:
        run(TrainParams(**{**SMALL, "run_name": None}), ctx)
    assert failed.value.error_type == "time-limit"
    assert list(ctx.registered) == ["run5@step0", "run5@step50", "run5@step59"]
    partial = failed.value.partial
    assert partial.summary["partial"] is True and partial.summary["steps"] == 59
    assert "stopped by the time limit after step 59 of 150" in partial.summary["note"]
    ref_train = _series(reference[1], "loss.train")
    assert _series(partial, "loss.train").y == pytest.approx(list(ref_train.y[:59]), rel=1e-5)
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")

    # A limit that comes with the last step is a finished run.
    done = run(TrainParams(**{**SMALL, "run_name": None}),
               FailingContext(tmp_path / "last", datasets={"wiki": docs}, job_id=6, at=150, error=time_limit()))
    assert done.summary["steps"] == 150 and "partial" not in done.summary
    assert _series(done, "loss.val").y == pytest.approx(list(_series(reference[1], "loss.val").y), rel=1e-5)


def test_llama_with_grouped_query_attention_and_a_trained_bpe(docs, tmp_path):
    ctx = LocalContext(tmp_path, datasets={"wiki": docs[:100]}, job_id=4)
    out = run(TrainParams(dataset="wiki", architecture="llama", layers=1, width=32, heads=4, kv_heads=2, context=16,
                          vocab_size=300, steps=3, warmup_steps=1, batch_size=2, eval_batches=1, val_fraction=0.1), ctx)
    lm = load_model("x", "checkpoint", str(ctx.registered["run4@step3"][0]))
    assert lm.info["num_kv_heads"] == 2 and lm.info["gated_ffn"] and lm.info["vocab_size"] == 300
    assert out.summary["vocab_size"] == len(lm.tokenizer) == 300
    assert lm.tokenizer.decode(lm.tokenizer(docs[0], add_special_tokens=False)["input_ids"]) == docs[0]


@pytest.mark.parametrize("bad, message", [
    (dict(width=100, heads=3), "not divisible by heads"),
    (dict(kv_heads=2), "llama"),
    (dict(architecture="llama", heads=4, kv_heads=3), "multiple of kv_heads"),
    (dict(steps=50, warmup_steps=50), "warmup_steps"),
    (dict(run_name="has space"), "run_name"),
    (dict(learning_rate=1e-3), "learning_rate"),
])
def test_bad_parameters_are_refused_with_a_reason(bad, message):
    with pytest.raises(ValidationError, match=message):
        validate_params("train", {"dataset": "wiki", **bad})


@pytest.mark.parametrize("steps, warmup", [(1000, 100), (5000, 100), (300, 30), (50, 5), (9, 0), (1, 0)])
def test_the_default_warm_up_is_a_tenth_of_a_short_run(steps, warmup):
    """Left out, warmup_steps is min(100, steps // 10): a short run is accepted rather than refused for
    a warm-up longer than itself, and the value used is the one stored."""
    params = validate_params("train", {"dataset": "wiki", "steps": steps})
    assert params.warmup_steps == warmup
    assert params.model_dump()["warmup_steps"] == warmup


def test_parameters_survive_a_round_trip_through_json():
    """The API stores model_dump() and the worker validates it again: that must not change or refuse anything."""
    for raw in ({"dataset": "d"}, {"dataset": "d", "tokenizer": "bytes", "architecture": "llama", "kv_heads": 2}):
        params = validate_params("train", raw)
        assert validate_params("train", params.model_dump(mode="json")) == params


def test_tokenizer_of_a_registered_model_is_a_model_reference():
    assert TrainParams(dataset="d", tokenizer="gpt2-small").model_refs() == ["gpt2-small"]
    assert TrainParams(dataset="d").model_refs() == [] and TrainParams(dataset="d").dataset_refs() == ["d"]


def test_too_small_a_dataset_fails_clearly(tmp_path):
    from lmscope.analyses.base import JobFailed

    ctx = LocalContext(tmp_path, datasets={"wiki": ["a few words here", "and a few more"]})
    with pytest.raises(JobFailed, match="lower context"):
        run(TrainParams(dataset="wiki", tokenizer="bytes", context=64, steps=5, warmup_steps=1), ctx)


def test_training_sees_documents_as_the_checkpoints_tokenizer_encodes_them():
    """With a tokenizer that adds BOS (a registered model's), every document starts with it in training
    too; lmscope's own tokenizers add none, so their streams hold no BOS at all."""
    from lmscope.modeling.tokenization import byte_tokenizer
    from lmscope.modeling.windows import token_windows

    bos, eos = 256, 257
    with_bos = token_windows(byte_tokenizer(), ["ab", "c"], 6, None, special=True).tolist()
    assert with_bos == [[bos, 97, 98, eos, bos, 99]]
    plain = token_windows(byte_tokenizer(add_bos=False), ["ab", "c"], 4, None, special=True).tolist()
    assert plain == [[97, 98, eos, 99]]


def test_a_run_trains_on_the_stream_its_tokenizer_encodes_bos_included(docs, tmp_path):
    """With a registered model's tokenizer (tiny-gpt2's byte tokenizer puts <bos> first) the job trains
    on that tokenizer's special-token stream, as its checkpoints will read text."""
    from lmscope.analyses.train import split_documents
    from lmscope.modeling.tokenization import byte_tokenizer
    from lmscope.modeling.windows import token_windows

    params = TrainParams(**{**SMALL, "tokenizer": "tiny-gpt2", "steps": 2, "warmup_steps": 1, "checkpoint_every": 2,
                            "eval_every": 2, "eval_batches": 1})
    out = run(params, LocalContext(tmp_path, datasets={"wiki": docs}, job_id=1))
    train_docs, _ = split_documents(docs, params.val_fraction)
    bos_stream = byte_tokenizer()(train_docs[0])["input_ids"]
    assert bos_stream[0] == 256  # the tokenizer adds <bos>: with special tokens the stream is longer
    with_bos, plain = (token_windows(byte_tokenizer(), train_docs, params.context + 1, None, special=special).numel()
                       for special in (True, False))
    assert with_bos != plain
    assert out.summary["train_tokens"] == with_bos


def test_each_epoch_visits_every_window_once_in_its_own_order():
    order = BatchOrder(12, 4, 3)
    epochs = [torch.cat([order(step) for step in range(e * 3, e * 3 + 3)]).tolist() for e in range(3)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # reshuffled every epoch


def test_only_matrices_and_embeddings_decay_with_the_documented_adamw():
    """docs/models-and-datasets.md: AdamW (β = 0.9, 0.95), decay on matrices and embeddings only (not biases,
    not norm gains)."""
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "proj": torch.nn.Linear(4, 4),
                                 "norm": torch.nn.LayerNorm(4)})
    p = TrainParams(dataset="d", weight_decay=0.25, lr=0.01)
    optimizer = make_optimizer(model, p)
    names = {id(prm): name for name, prm in model.named_parameters()}
    groups = {g["weight_decay"]: sorted(names[id(prm)] for prm in g["params"]) for g in optimizer.param_groups}
    assert groups == {0.25: ["emb.weight", "proj.weight"], 0.0: ["norm.bias", "norm.weight", "proj.bias"]}
    assert all(g["lr"] == 0.01 and g["betas"] == (0.9, 0.95) for g in optimizer.param_groups)


def test_validation_loss_weighs_every_token_the_same_with_a_short_last_batch():
    """5 windows in batches of 2: the last batch holds one window, which counts for 1/5, not 1/3."""
    from contextlib import nullcontext

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)).eval()
    windows = torch.randint(0, 50, (5, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits.double()
    by_hand = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), windows[:, 1:].reshape(-1)).item()
    assert evaluate(model, windows, 2, nullcontext) == pytest.approx(by_hand, abs=1e-6)


def test_every_valid_seed_orders_batches():
    """Seeds up to 2^63 − 1 are valid; seed·1_000_003 overflowed manual_seed from about 1.8e13."""
    big = BatchOrder(100, 4, 2**63 - 1)
    assert sorted(torch.cat([big(s) for s in range(25)]).tolist()) == list(range(100))  # one epoch: a permutation
    small = BatchOrder(100, 4, 7)  # seeds that fitted keep their order (runs resume as before)
    g = torch.Generator().manual_seed(7 * 1_000_003 + 0)
    assert small(0).tolist() == torch.randperm(100, generator=g)[:4].tolist()


def test_long_runs_are_thinned_to_block_means_at_each_blocks_last_step():
    """Series of runs past 5000 steps: block means, x = the block's last step (a worked example)."""
    from lmscope.analyses.train import thin

    xs, ys = thin([[i, float(i)] for i in range(1, 13)], max_points=5)  # stride ⌈12/5⌉ = 3
    assert xs == [3, 6, 9, 12] and ys == [2.0, 5.0, 8.0, 11.0]
    xs, ys = thin([[i, float(i * i)] for i in range(1, 8)], max_points=5)  # stride 2, a short last block
    assert xs == [2, 4, 6, 7] and ys == [2.5, 12.5, 30.5, 49.0]
    assert thin([[1, 2.0], [2, 3.0]]) == ([1, 2], [2.0, 3.0])  # short runs: as they are


@pytest.mark.parametrize("steps, every, written", [(1000, 250, 5), (1000, 300, 5), (60, 1, 61), (99, 1, 100),
                                                   (1, 250, 2)])
def test_checkpoint_count_is_step_0_every_n_and_the_last(steps, every, written):
    from lmscope.params.train import checkpoint_count

    expected = len({0, *range(every, steps + 1, every), steps})  # the steps the run loop checkpoints at
    assert checkpoint_count(steps, every) == expected == written


def test_a_run_writes_at_most_100_checkpoints():
    """Each checkpoint is a copy of the weights and a registered model: an explicit checkpoint_every that
    writes more is refused saying the smallest that fits; left out, it is raised to fit (and stored so)."""
    with pytest.raises(ValidationError, match=r"writes 101 checkpoints .* use checkpoint_every=2 or more") as refused:
        validate_params("train", {"dataset": "wiki", "steps": 100, "checkpoint_every": 1})
    assert refused.value.errors()[0]["loc"] == ("checkpoint_every",)  # the field to change
    assert validate_params("train", {"dataset": "wiki", "steps": 99, "checkpoint_every": 1}).checkpoint_every == 1
    long = validate_params("train", {"dataset": "wiki", "steps": 100_000})
    assert long.checkpoint_every == 1011  # ⌈100000 / 99⌉: 1 + ⌈100000 / 1011⌉ = 100 checkpoints
    assert len({0, *range(1011, 100_001, 1011), 100_000}) == 100
    assert validate_params("train", long.model_dump(mode="json")) == long  # the API's stored form
    assert validate_params("train", long.model_dump(mode="json"), internal=True) == long  # the worker's
    # a row stored before the limit (the default 250 over 100000 steps: 401 checkpoints) still runs as accepted
    old = {**long.model_dump(mode="json"), "checkpoint_every": 250}
    assert validate_params("train", old, internal=True).checkpoint_every == 250
    with pytest.raises(ValidationError, match="writes 401 checkpoints"):
        validate_params("train", old)  # as a new submission it is refused
    assert validate_params("train", {"dataset": "wiki", "steps": 1000}).checkpoint_every == 250  # the default


def test_a_checkpoint_the_disk_cannot_hold_fails_the_run_keeping_what_it_trained(docs, tmp_path, monkeypatch):
    """Before each checkpoint the run checks the artifact store's free space for weights + AdamW state (3×
    the parameters' bytes, a tied embedding once) + 5 % of the disk (at least 1 GiB) left for others: short
    at step 0, the job fails at once (disk-full); short later, like the time limit, it fails keeping its
    curves and the checkpoints written."""
    import shutil
    from collections import namedtuple
    from types import SimpleNamespace

    import lmscope.analyses.train as train_module

    usage = namedtuple("usage", "total used free")
    total = 1 << 40
    spare = total // 20  # 5 % of a 1 TiB disk: more than the 1 GiB floor

    def free_space(free_after):  # free bytes, by how many checkpoints the run has written so far
        return SimpleNamespace(rmtree=shutil.rmtree,
                               disk_usage=lambda path: usage(total, 0, free_after(len(ctx.registered))))

    params = TrainParams(**{**SMALL, "run_name": None})
    ctx = LocalContext(tmp_path / "first", datasets={"wiki": docs}, job_id=7)
    monkeypatch.setattr(train_module, "shutil", free_space(lambda n: spare))  # the part to spare, no more
    with pytest.raises(JobFailed, match="the run's 4 checkpoints still to write need about") as failed:
        run(params, ctx)
    assert failed.value.error_type == "disk-full" and failed.value.partial is None and ctx.registered == {}

    def saved_weights() -> int:  # the step-0 checkpoint's weights as saved (a tied embedding / LM head once)
        from safetensors import safe_open

        with safe_open(str(ctx.registered["run8@step0"][0] / "model.safetensors"), "pt") as f:
            return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())

    def exactly_enough_until_step_100(n):  # at step 150 one byte short
        return total if n < 2 else 3 * saved_weights() + spare - (n > 2)

    ctx = LocalContext(tmp_path / "later", datasets={"wiki": docs}, job_id=8)
    monkeypatch.setattr(train_module, "shutil", free_space(exactly_enough_until_step_100))
    with pytest.raises(JobFailed, match="the checkpoint at step 150 needs") as failed:
        run(params, ctx)
    assert failed.value.error_type == "disk-full"
    assert list(ctx.registered) == ["run8@step0", "run8@step50", "run8@step100"]
    partial = failed.value.partial
    assert partial.summary["partial"] is True and partial.summary["steps"] == 150
    assert f"{spare / 2**30:.1f} GiB left free for others" in str(failed.value)  # 51.2 GiB

    # Room for three of the run's four checkpoints (0, 50, 100, 150) and AdamW's state: refused before
    # training, not at step 150.
    three = (3 + 2) * saved_weights() + spare  # run8's step-0 checkpoint: the same model
    ctx = LocalContext(tmp_path / "whole", datasets={"wiki": docs}, job_id=9)
    monkeypatch.setattr(train_module, "shutil", free_space(lambda n: three))
    with pytest.raises(JobFailed, match="the run's 4 checkpoints still to write need about") as failed:
        run(params, ctx)
    assert failed.value.partial is None and ctx.registered == {}


def test_a_diverging_run_stops_at_the_first_non_finite_loss_keeping_its_finite_checkpoints(reference, docs, tmp_path,
                                                                                          monkeypatch):
    """A loss that overflows (as bf16 or too high an lr makes it) stops the run, failed `diverged`: no NaN
    weights are trained on, checkpointed or registered; the curves and checkpoints before it are kept."""
    import lmscope.analyses.train as train_module

    calls = {"n": 0}
    real_loss = train_module.next_token_loss

    def overflowing_at_step_61(model, windows, autocast):  # evaluations run under no_grad: not counted
        loss = real_loss(model, windows, autocast)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 61:
                return loss * float("inf")
        return loss

    monkeypatch.setattr(train_module, "next_token_loss", overflowing_at_step_61)
    ctx = LocalContext(tmp_path, datasets={"wiki": docs}, job_id=4)
    with pytest.raises(JobFailed, match="the training loss at step 61 is (inf|nan): the run diverged") as failed:
        run(TrainParams(**{**SMALL, "run_name": None}), ctx)
    assert failed.value.error_type == "diverged"
    assert list(ctx.registered) == ["run4@step0", "run4@step50"]  # no checkpoint of the broken step
    partial = failed.value.partial.summary
    assert partial["steps"] == 60 and "stopped: the loss diverged after step 60" in partial["note"]
    train = _series(failed.value.partial, "loss.train")
    assert list(train.x) == list(range(1, 61))
    assert train.y == pytest.approx(list(_series(reference[1], "loss.train").y[:60]), rel=1e-5)
    for name, (path, _) in ctx.registered.items():
        lm = load_model(name, "checkpoint", str(path))
        assert all(torch.isfinite(p).all() for p in lm.model.parameters())


def test_a_nan_gradient_with_a_finite_loss_is_caught_before_its_checkpoint(docs, tmp_path, monkeypatch):
    """Clipping cannot repair a NaN gradient: the weights turn NaN though the step's loss was finite. The
    next checkpoint refuses them (failed `diverged`), rather than register a model of NaNs."""
    import lmscope.analyses.train as train_module

    def poisoned_clip(parameters, max_norm):
        for p in parameters:
            if p.grad is not None:
                p.grad.fill_(float("nan"))

    monkeypatch.setattr(train_module.torch.nn.utils, "clip_grad_norm_", poisoned_clip)
    ctx = LocalContext(tmp_path, datasets={"wiki": docs}, job_id=5)
    params = TrainParams(**{**SMALL, "run_name": None, "steps": 3, "checkpoint_every": 1, "eval_every": 100,
                            "warmup_steps": 1})
    with pytest.raises(JobFailed, match="diverged") as failed:
        run(params, ctx)
    assert failed.value.error_type == "diverged" and list(ctx.registered) == ["run5@step0"]


def test_a_registered_models_tokenizer_is_read_without_its_weights(docs, tmp_path):
    """tokenizer=<model>: only the tokenizer is loaded (a 7B tokenizer source would otherwise sit on the
    training GPU all run); the run trains on that tokenizer's ids."""
    source = LocalContext(tmp_path / "source", datasets={"wiki": docs}, job_id=11)
    run(TrainParams(**{**SMALL, "steps": 2, "checkpoint_every": 2, "warmup_steps": 1, "run_name": "src"}), source)

    class NoWeights(LocalContext):
        def load_model(self, name, *, dtype="float32"):
            raise AssertionError(f"loaded the weights of {name}")

    ctx = NoWeights(tmp_path / "b", datasets={"wiki": docs}, job_id=12)
    ctx.registered.update(source.registered)
    out = run(TrainParams(**{**SMALL, "tokenizer": "src@step2", "steps": 2, "warmup_steps": 1, "run_name": "b"}), ctx)
    assert out.summary["vocab_size"] == len(load_model("src@step2", "checkpoint",
                                                       str(source.registered["src@step2"][0])).tokenizer)


def test_a_stop_checkpoint_that_cannot_be_written_leaves_the_stop_and_its_results(docs, tmp_path, monkeypatch):
    """The checkpoint of the step a timed-out run reached fails to write (a full disk): the job still fails
    `time-limit` with its partial results, the regular checkpoints stay, and no half-written folder is left."""
    import lmscope.analyses.train as train_module

    real_save = train_module.save_checkpoint

    def failing_at_59(root, step, *args):
        if step == 59:
            (root / f".step-{step}.tmp").mkdir()
            raise OSError(28, "No space left on device")
        return real_save(root, step, *args)

    monkeypatch.setattr(train_module, "save_checkpoint", failing_at_59)
    ctx = FailingContext(tmp_path, datasets={"wiki": docs}, job_id=5, at=59,
                         error=JobFailed("the job ran past its time limit", error_type="time-limit"))
    with pytest.raises(JobFailed, match="time limit") as failed:
        run(TrainParams(**{**SMALL, "run_name": None}), ctx)
    assert failed.value.error_type == "time-limit" and failed.value.partial.summary["steps"] == 59
    assert list(ctx.registered) == ["run5@step0", "run5@step50"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0", "step-50"]
