"""`operator`: each head's input dependence against the explicit float64 map W'(x)·x with its attention weights
replaced (built from eager attention matrices and the weights, not through the job's attention function); models
whose attention is uniform whatever the input give 0 on every architecture; the job through the service."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers as T

from lmscope.analyses import operator
from lmscope.analyses.base import JobFailed, LoadedModel
from lmscope.analyses.local import LocalContext
from lmscope.catalog import read_documents
from lmscope.config import Settings
from lmscope.modeling.tokenization import byte_tokenizer
from lmscope.modeling.windows import token_windows
from lmscope.params.operator import OperatorParams
from tests.analyses.test_architectures import CONFIGS
from tests.analyses.test_pruning import explicit_values, tiny
from tests.conftest import runs_through_lmscope_attention

SEQ_LEN = 20


@pytest.fixture(scope="module")
def documents():
    return read_documents(Settings.from_env().wikitext2_path, "lines")[:80]


def run_job(tmp_path, loaded: dict, documents, **params):
    ctx = LocalContext(tmp_path, models=loaded, datasets={"wiki": documents})
    params = {"dataset": "wiki", "seq_len": SEQ_LEN, "num_segments": 7, "batch_size": 3, **params}
    if "models" not in params:
        params["model"] = next(iter(loaded))
    return operator.run(OperatorParams(**params), ctx), ctx


@torch.no_grad()
def explicit_terms(loaded: LoadedModel, windows: torch.Tensor) -> tuple[list, list, list]:
    """Float64 per layer: the eager attention matrices A [W, H, N, N], the values v [W, H, N, d] (from the block's
    input through its own projections, key/value heads repeated per query head) and W_O per head [H, d, D_out]."""
    model = copy.deepcopy(loaded.model).double()
    model.set_attn_implementation("eager")
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    run = model(input_ids=windows, output_attentions=True, output_hidden_states=True, use_cache=False)
    As, vs, w_os = [], [], []
    for layer, block in enumerate(blocks):
        x, A = run.hidden_states[layer], run.attentions[layer]
        v, w_o, _ = explicit_values(block, x, A.shape[1])
        As.append(A)
        vs.append(v)
        w_os.append(w_o.detach())
    return As, vs, w_os


def relative_change(A, replaced, v, w_o) -> tuple[np.ndarray, float, np.ndarray]:
    """Per head, for the layer (heads summed) and per position: ‖(Ã − A) v W_O‖ / ‖A v W_O‖ over windows, tokens."""
    o = torch.einsum("whtj,whjd,hde->wthe", A, v, w_o)  # [W, N, H, D_out]
    do = torch.einsum("whtj,whjd,hde->wthe", replaced - A, v, w_o)
    head = (do.pow(2).sum((0, 1, 3)) / o.pow(2).sum((0, 1, 3))).sqrt().numpy()
    layer = float((do.sum(2).pow(2).sum() / o.sum(2).pow(2).sum()).sqrt())
    by_position = (do.sum(2).pow(2).sum((0, 2)) / o.sum(2).pow(2).sum((0, 2))).sqrt().numpy()
    return head, layer, by_position


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_input_dependence_is_the_explicit_map_with_its_weights_replaced(arch, documents, tmp_path):
    """Seven windows in batches of three: [0 1 2] and [3 4 5 6] (a last window alone joins the batch before it),
    so window w takes the weights of the window before it in its batch, the first the last's. The mean is over
    all seven windows; uniform is 1/(t + 1) over the keys up to t."""
    loaded = tiny(arch)
    out, ctx = run_job(tmp_path, {"m": loaded}, documents)
    windows = token_windows(loaded.tokenizer, documents, SEQ_LEN, 7)
    partner = [2, 0, 1, 6, 3, 4, 5]
    uniform = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.float64).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    saved = np.load(tmp_path / "operator.npz")
    assert list(saved["replacements"]) == ["other_window", "mean", "uniform"]
    for layer, (A, v, w_o) in enumerate(zip(*explicit_terms(loaded, windows))):
        for r, replaced in enumerate([A[partner], A.mean(0, keepdim=True).expand_as(A), uniform.expand_as(A)]):
            head, whole, by_position = relative_change(A, replaced, v, w_o)
            np.testing.assert_allclose(saved["input_dependence"][r, layer], head, rtol=1e-4)
            np.testing.assert_allclose(saved["layer_input_dependence"][r, layer], whole, rtol=1e-4)
            np.testing.assert_allclose(saved["by_position"][r, layer, 1:], by_position[1:], rtol=1e-4)
            assert saved["by_position"][r, layer, 0] < 1e-6  # position 0 sees one key: nothing to replace
            name = out.summary["replacements"][r]
            assert out.summary["input_dependence_by_layer"][name][layer] == pytest.approx(whole, rel=1e-4)
    assert (saved["input_dependence"] > 0.05).all()  # random-init heads depend on the input: the check can fail
    assert out.summary["reconstruction_error"] < 1e-5 and out.summary["tokens"] == 7 * SEQ_LEN
    most = out.summary["most_input_dependent_heads"][0]
    ranked = saved["input_dependence"][1]  # by the mean replacement
    assert (most["layer"], most["head"]) == np.unravel_index(ranked.argmax(), ranked.shape)
    series = {(s.labels["layer"], s.labels["replacement"]): s.y for s in out.series if s.name == "input_dependence"}
    np.testing.assert_allclose(series[(1, "uniform")], saved["input_dependence"][2, 1])
    done, total, _ = ctx.progress_log[-1]
    assert done == total == 2 * 2  # two passes (the mean's, then the measuring one) of two batches
    assert {"input_dependence.png", "input_dependence_by_position.png"} <= {p.name for p in tmp_path.iterdir()}


def module_head_dim(model) -> int:
    return getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads


def zero_queries(model) -> None:
    """Every query weight and bias zero: every attention row is uniform over its visible keys, whatever the
    input (RoPE and query norms keep a zero query zero, soft-capping keeps a zero score zero); fused
    projections are zeroed where each lays out its queries."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("q_proj"):
                for p in module.parameters():
                    p.zero_()
            elif name.endswith("attn.c_attn"):  # GPT-2's and GPTBigCode's fused q, k, v: the queries come first
                width = model.config.hidden_size
                if type(module).__name__ == "Conv1D":  # weight [in, out]
                    module.weight[:, :width] = 0
                else:
                    module.weight[:width] = 0
                module.bias[:width] = 0
            elif name.endswith("query_key_value"):  # GPT-NeoX: per head [q | k | v], each head_size wide
                heads = model.config.num_attention_heads
                module.weight.view(heads, 3, -1, module.weight.shape[-1])[:, 0] = 0
                if module.bias is not None:
                    module.bias.view(heads, 3, -1)[:, 0] = 0
            elif name.endswith("qkv_proj"):  # Phi-3: [all queries | keys | values]
                width = model.config.num_attention_heads * module_head_dim(model)
                module.weight[:width] = 0
                if module.bias is not None:
                    module.bias[:width] = 0


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_model_whose_attention_is_uniform_whatever_the_input_has_no_input_dependence(arch, documents, tmp_path):
    """Every architecture whose attention goes through the interface: with zero queries each head's map is mean
    pooling over the keys it sees (sliding windows and all), so every replacement gives 0; the model's logits
    through the job's attention function are its own. Architectures computing attention in their own modules
    are refused with what to do."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    named = [n for n, _ in model.named_modules()]
    if not runs_through_lmscope_attention(model):
        with pytest.raises(JobFailed, match=r"AttentionInterface.*study a model whose attention goes through .*"
                                            r"\(docs/models-and-datasets.md lists them\)"):
            run_job(tmp_path, {"m": LoadedModel("m", model, byte_tokenizer())}, documents, num_segments=2)
        return
    ids = torch.randint(0, 250, (2, 12))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        operator.register_attention()
        from lmscope.kernels.hf import attention_implementation

        with attention_implementation(model, operator.ATTENTION_NAME):
            through = model(input_ids=ids).logits
    torch.testing.assert_close(through, own, rtol=1e-5, atol=1e-5)
    assert any(n.endswith(("q_proj", "attn.c_attn", "query_key_value", "qkv_proj")) for n in named), named
    zero_queries(model)
    out, _ = run_job(tmp_path, {"m": LoadedModel("m", model, byte_tokenizer())}, documents, num_segments=4)
    saved = np.load(tmp_path / "operator.npz")
    assert saved["input_dependence"].max() < 1e-5, saved["input_dependence"].max()
    assert (saved["term_rms"] > 0).all()  # the heads add something: 0 is not a term of 0
    assert out.summary["reconstruction_error"] < 1e-5


def test_window_batches_never_leave_a_window_alone():
    assert [(s.start, s.stop) for s in operator.window_batches(7, 3)] == [(0, 3), (3, 7)]
    assert [(s.start, s.stop) for s in operator.window_batches(8, 3)] == [(0, 3), (3, 6), (6, 8)]
    assert [(s.start, s.stop) for s in operator.window_batches(2, 8)] == [(0, 2)]


def test_several_models_are_followed_across_steps(documents, tmp_path):
    """models=[run@step9, run@step0]: measured in step order, each as the same job on that model alone, the
    summary the last one's; a model with zero queries (uniform attention) has no input dependence."""
    first = tiny("gpt2", seed=1)
    later = tiny("gpt2", seed=2)
    zero_queries(later.model)
    models = {"run@step9": later, "run@step0": first}
    out, _ = run_job(tmp_path / "both", models, documents, models=["run@step9", "run@step0"],
                     replacements=["mean", "uniform"])
    over = out.summary["over_training"]
    assert over["steps"] == [0, 9] and over["models"] == ["run@step0", "run@step9"]
    assert out.summary["summary_of"] == out.summary["model"] == "run@step9"
    alone, _ = run_job(tmp_path / "alone", {"run@step0": first}, documents, replacements=["mean", "uniform"])
    for name in ("mean", "uniform"):
        assert over["mean_input_dependence"][name][0] == pytest.approx(alone.summary["mean_input_dependence"][name])
        assert over["mean_input_dependence"][name][1] < 1e-5
    lines = [s for s in out.series if s.name == "input_dependence.layer.over_training"]
    assert len(lines) == 3 * 2 and all(s.x == [0, 9] for s in lines)
    heads = [s for s in out.series if s.name == "input_dependence.over_training"]
    assert len(heads) == 3 * 4 * 2
    assert (tmp_path / "both" / "input_dependence_over_training.png").stat().st_size > 10_000


def test_what_the_job_cannot_measure_is_refused_with_what_to_change(documents, tmp_path, monkeypatch):
    loaded = tiny("gpt2")
    with pytest.raises(JobFailed, match="other_window needs two"):
        run_job(tmp_path, {"m": loaded}, ["one short document, ninety bytes long: " * 2 + "a"], seq_len=60,
                num_segments=2)
    monkeypatch.setattr("lmscope.params.operator.MEAN_ATTENTION_BYTES", 1000)
    with pytest.raises(JobFailed, match="lower seq_len or drop 'mean'"):
        run_job(tmp_path, {"m": loaded}, documents)
    out, _ = run_job(tmp_path, {"m": loaded}, documents, replacements=["other_window"])
    assert out.summary["ranked_by"] == "other_window"


@pytest.mark.parametrize("wrong", ["weights", "output"])
def test_weights_that_did_not_make_the_output_fail_the_job(wrong, documents, tmp_path, monkeypatch):
    """A·v must give the attention output the model computed: weights shifted by a row (or an output gone NaN)
    mean D would not measure the model's map, so the job fails naming the layers instead of reporting it."""
    import transformers.models.gpt2.modeling_gpt2 as gpt2

    own = gpt2.eager_attention_forward

    def tampered(module, query, key, value, mask, **kwargs):
        out, weights = own(module, query, key, value, mask, **kwargs)
        if wrong == "weights":
            return out, weights.roll(1, dims=-2)
        return (out * float("nan") if module.layer_idx == 2 else out), weights  # the last layer: the terms stay finite

    monkeypatch.setattr(gpt2, "eager_attention_forward", tampered)
    said = r"0, 1, 2: the attention weights read.*by [0-9.]+, [0-9.]+, [0-9.]+ of" if wrong == "weights" else r"2: .* by nan of"
    with pytest.raises(JobFailed, match=rf"layer\(s\) {said} its norm \(at most 0.0001 in float32\)"):
        run_job(tmp_path, {"m": tiny("gpt2")}, documents, replacements=["uniform"])


def test_a_layer_whose_attention_skips_the_interface_fails_the_job_in_either_pass(documents, tmp_path):
    """A block computing its attention in its own module never hands its weights over: the job says which layer,
    in the mean's pass as in the measuring one (not a TypeError from a missing sum)."""
    for replacements in (["mean"], ["uniform"]):
        loaded = tiny("gpt2")
        attention = loaded.model.transformer.h[1].attn
        attention.forward = lambda hidden_states, *args, **kwargs: (torch.zeros_like(hidden_states), None)
        with pytest.raises(JobFailed, match=r"layer\(s\) 1 did not go through transformers' AttentionInterface"
                                            r".*docs/models-and-datasets.md"):
            run_job(tmp_path, {"m": loaded}, documents, replacements=replacements)


def test_a_silent_head_has_no_input_dependence_and_no_rank(documents, tmp_path):
    """A head whose output projection is zero adds nothing: its D is undefined (NaN in the npz, null in the
    series), it is listed as silent and never ranked least input-dependent; the other heads are unchanged."""
    loaded = tiny("gpt2")
    before, _ = run_job(tmp_path / "before", {"m": loaded}, documents)
    head_dim = 32 // 4
    with torch.no_grad():
        loaded.model.transformer.h[2].attn.c_proj.weight[head_dim:2 * head_dim] = 0  # Conv1D [in, out]: head 1
    after, _ = run_job(tmp_path / "after", {"m": loaded}, documents)
    was = np.load(tmp_path / "before" / "operator.npz")["input_dependence"]
    now = np.load(tmp_path / "after" / "operator.npz")["input_dependence"]
    assert np.isnan(now[:, 2, 1]).all() and np.isfinite(np.delete(now.reshape(3, -1), 2 * 4 + 1, axis=1)).all()
    np.testing.assert_allclose(np.delete(now.reshape(3, -1), 9, axis=1), np.delete(was.reshape(3, -1), 9, axis=1),
                               rtol=1e-6)
    assert after.summary["silent_heads"] == [{"layer": 2, "head": 1}] and before.summary["silent_heads"] == []
    ranked = {(h["layer"], h["head"]) for h in after.summary["least_input_dependent_heads"]
              + after.summary["most_input_dependent_heads"]}
    assert (2, 1) not in ranked and len(after.summary["least_input_dependent_heads"]) == operator.NAMED_HEADS
    least = min((v, l, h) for (l, h), v in np.ndenumerate(now[1]) if np.isfinite(v))
    assert after.summary["least_input_dependent_heads"][0] == {"layer": least[1], "head": least[2],
                                                               "input_dependence": pytest.approx(least[0])}
    series = next(s for s in after.series if s.name == "input_dependence" and s.labels == {"layer": 2,
                                                                                          "replacement": "mean"})
    assert np.isnan(series.y[1])  # stored as null (the runner turns NaN into JSON null)


def test_in_bfloat16_the_job_measures_what_float32_measures(documents, tmp_path):
    """The half-precision route (weights rounded, softmax in float32, output in bfloat16) passes its own
    reconstruction tolerance and gives D close to float32's."""
    loaded = tiny("llama")
    full, _ = run_job(tmp_path / "fp32", {"m": loaded}, documents)
    half = LoadedModel("m", copy.deepcopy(loaded.model).to(torch.bfloat16), loaded.tokenizer)
    rounded, _ = run_job(tmp_path / "bf16", {"m": half}, documents, dtype="bfloat16")
    assert 1e-5 < rounded.summary["reconstruction_error"] < operator.RECONSTRUCTION_TOLERANCE["bfloat16"]
    np.testing.assert_allclose(np.load(tmp_path / "bf16" / "operator.npz")["input_dependence"],
                               np.load(tmp_path / "fp32" / "operator.npz")["input_dependence"], rtol=0.05, atol=0.01)


@pytest.mark.parametrize("given, said", [({"replacements": ["mean", "mean"]}, "twice"),
                                         ({"batch_size": 1}, "batch_size"), ({"num_segments": 1}, "num_segments"),
                                         ({"replacements": ["median"]}, "replacements")])
def test_parameters_are_checked(given, said):
    with pytest.raises(ValueError, match=said):
        OperatorParams(model="m", dataset="d", **given)


def test_the_job_through_the_service(service):
    """Submitted over HTTP, run by the embedded worker on a grouped-query LLaMA: summary, series, plots, progress."""
    client, worker, _ = service
    r = client.post("/v1/jobs", json={"kind": "operator", "params": {"model": "tiny-llama", "dataset": "wikitext-2",
                                                                     "seq_len": 32, "num_segments": 4}})
    assert r.status_code == 202, r.get_json()
    job_id = r.get_json()["id"]
    assert worker.run_once()
    job = client.get(f"/v1/jobs/{job_id}").get_json()
    assert job["status"] == "succeeded", job["error"]
    assert job["progress"]["done"] == job["progress"]["total"]
    assert job["environment"]["kernel_backend"] == "transformers-eager (lmscope_operator)"
    s = job["summary"]
    assert s["replacements"] == ["other_window", "mean", "uniform"] and s["windows"] == 4
    series = client.get(f"/v1/jobs/{job_id}/results?series=input_dependence.layer").get_json()["series"]
    assert {x["labels"]["replacement"] for x in series} == set(s["replacements"])
    assert all(x["y"] == s["input_dependence_by_layer"][x["labels"]["replacement"]] for x in series)
    names = {a["name"] for a in client.get(f"/v1/jobs/{job_id}/artifacts").get_json()["items"]}
    assert {"input_dependence.png", "input_dependence_by_position.png", "operator.npz"} <= names
    from lmscope import demo  # what `make demo` prints of it

    means, least = demo.headline(job)
    assert means.endswith("mean over heads: " + ", ".join(f"{r} {s['mean_input_dependence'][r]:.2f}"
                                                          for r in s["replacements"]))
    head = s["least_input_dependent_heads"][0]
    assert least == f"least input-dependent head: layer {head['layer']} head {head['head']} ({head['input_dependence']:.2f})"
    bad = client.post("/v1/jobs", json={"kind": "operator", "params": {"model": "tiny-llama", "dataset": "wikitext-2",
                                                                       "replacements": ["mean", "mean"]}})
    assert bad.status_code == 422 and "twice" in bad.get_data(as_text=True)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gemma2", "llama"])
def test_the_job_on_the_device_matches_the_cpu(arch, device, documents, tmp_path):
    """What a GPU worker runs (the weights, the mean pattern and the masks on the model's device; Gemma 2's soft-capped
    scores) against the same job on the CPU."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    saved = []
    for where, on in (("cpu", "cpu"), ("device", device)):
        loaded = LoadedModel("m", copy.deepcopy(model).to(on), byte_tokenizer())
        ctx = LocalContext(tmp_path / where, models={"m": loaded}, datasets={"wiki": documents}, device=on)
        operator.run(OperatorParams(model="m", dataset="wiki", seq_len=SEQ_LEN, num_segments=5, batch_size=2), ctx)
        saved.append(np.load(tmp_path / where / "operator.npz"))
    for key in ("input_dependence", "layer_input_dependence", "by_position", "term_rms"):
        np.testing.assert_allclose(saved[1][key], saved[0][key], rtol=1e-4, atol=1e-6)
