"""The `probe` job kind: parameter counts per part equal sums over the modules that own them."""

from __future__ import annotations

import math

import pytest
import torch

from lmscope.analyses.local import LocalContext
from lmscope.analyses.probe import run
from lmscope.params.probe import ProbeParams
from tests.conftest import need_module

PROMPT = "The tower is 324 metres tall , about the same height as an 81 @-@ storey building ."


def numel(*modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def expected_groups(model) -> tuple[dict[str, int], list[int], list[int]]:
    """Counts from the module tree (not from parameter names): totals, attention and MLP per layer."""
    if model.config.model_type == "gpt2":
        t = model.transformer
        blocks, attn, mlp = t.h, [b.attn for b in t.h], [b.mlp for b in t.h]
        norms = [b.ln_1 for b in t.h] + [b.ln_2 for b in t.h] + [t.ln_f]
        embeddings = [t.wte, t.wpe]
    else:
        m = model.model
        blocks, attn, mlp = m.layers, [b.self_attn for b in m.layers], [b.mlp for b in m.layers]
        norms = [b.input_layernorm for b in m.layers] + [b.post_attention_layernorm for b in m.layers] + [m.norm]
        embeddings = [m.embed_tokens]
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    groups = {"embeddings": numel(*embeddings), "attention": numel(*attn), "mlp": numel(*mlp),
              "norms": numel(*norms), "head": 0 if tied else numel(model.lm_head)}
    assert numel(*blocks) == sum(numel(b) for b in attn + mlp) + numel(*norms) - numel(norms[-1])
    return groups, [numel(a) for a in attn], [numel(m) for m in mlp]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_parameter_counts_and_prompt_loss(name, tmp_path):
    ctx = LocalContext(tmp_path)
    out = run(ProbeParams(model=name, prompt=PROMPT), ctx)
    s = out.summary
    model = ctx.load_model(name).model  # built-ins are bit-identical on every load
    assert ctx.environment["kernel_backend"] == f"transformers-{model.config._attn_implementation}"
    groups, attn_by_layer, mlp_by_layer = expected_groups(model)

    assert s["parameters"] == groups
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # tied weights once
    assert s["num_parameters"] == sum(unique.values()) == sum(groups.values())
    assert s["tied_embeddings"] == (name == "tiny-gpt2")
    assert (s["num_layers"], s["num_heads"], s["hidden_size"], s["vocab_size"], s["head_dim"]) == (4, 4, 64, 259, 16)
    assert s["num_kv_heads"] == (2 if name == "tiny-llama" else 4)
    assert s["gated_ffn"] == (name == "tiny-llama")

    by_layer = {sr.labels["group"]: sr for sr in out.series if sr.name == "parameters.by_layer"}
    assert by_layer["attention"].x == [0, 1, 2, 3]
    assert by_layer["attention"].y == attn_by_layer and by_layer["mlp"].y == mlp_by_layer

    # The prompt loss against HF's own shifted loss, and against a float64 recomputation.
    ids = ctx.load_model(name).tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hf = model(input_ids=ids, labels=ids).loss.item()
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    by_hand = -logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].mean().item()
    assert s["prompt_tokens"] == ids.shape[1] == len(PROMPT.encode()) + 1
    assert s["prompt_loss"] == pytest.approx(by_hand, abs=1e-5) == pytest.approx(hf, abs=1e-5)
    assert s["prompt_loss"] == pytest.approx(math.log(259), abs=0.5)  # random init: about uniform
    assert s["prompt_perplexity"] == pytest.approx(math.exp(by_hand), rel=1e-5)  # e^loss, the loss in nats
    # the model's likeliest token after the whole prompt (its last position's)
    assert s["next_token"] == ctx.load_model(name).tokenizer.decode([int(logp[-1].argmax())])
    assert (tmp_path / "parameters.png").read_bytes()[:4] == b"\x89PNG"
    assert [done for done, _, _ in ctx.progress_log] == [1, 2, 3]


class RecordingContext(LocalContext):
    """A LocalContext that keeps the model the job loaded and the dtype of every forward pass's logits."""

    def load_model(self, name, *, dtype="float32"):
        self.loaded = super().load_model(name, dtype=dtype)
        self.logits_dtypes = []
        self.loaded.model.register_forward_hook(lambda module, args, out: self.logits_dtypes.append(out.logits.dtype))
        return self.loaded


def _loss_by_hand(model, ids) -> float:
    """Mean next-token cross-entropy of the model's own logits, in float64."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    return -logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].mean().item()


def test_probe_in_bfloat16(tmp_path):
    ctx = RecordingContext(tmp_path / "bf16")
    out = run(ProbeParams(model="tiny-llama", dtype="bfloat16", prompt=PROMPT), ctx)
    s = out.summary
    assert s["dtype"] == "bfloat16" and math.isfinite(s["prompt_loss"])
    # It really ran in bfloat16: every parameter the job loaded, and the logits of its one forward pass.
    assert {p.dtype for p in ctx.loaded.model.parameters()} == {torch.bfloat16}
    assert ctx.logits_dtypes == [torch.bfloat16]

    ids = ctx.loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert s["prompt_tokens"] == ids.shape[1] == len(PROMPT.encode()) + 1
    # the loss of those bf16 logits (the job takes the cross-entropy in float32, here float64)
    assert s["prompt_loss"] == pytest.approx(_loss_by_hand(ctx.loaded.model, ids), abs=1e-4)
    # and within bf16 rounding of the float32 model's loss, recomputed here: bf16 keeps 8 significant bits
    # (relative rounding 2⁻⁹ ≈ 0.002 per weight and activation); on this 4-layer random-init model the
    # loss of ~ln 259 ≈ 5.5 nats moves by ~5e-4 (measured), and 0.05 nats leaves room for other torch
    # builds while catching a model that is not the same one (e.g. weights changed after loading)
    f32 = LocalContext(tmp_path / "f32").load_model("tiny-llama")
    assert next(f32.model.parameters()).dtype == torch.float32
    assert s["prompt_loss"] == pytest.approx(_loss_by_hand(f32.model, ids), abs=0.05)


def _built(config_class, **fields):
    transformers = need_module("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                                 vocab_size=100, **fields)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("config_class, fields, kv, head_dim", [
    ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, intermediate_size=64), 2, 32),  # q_norm, k_norm
    ("FalconConfig", dict(), 1, 16),  # multi_query: one key/value head
    ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2), 2, 16),  # ln_attn, ln_mlp
    ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=64), 4, 16),  # fc1, fc2
])
def test_groups_and_shapes_of_other_architectures(config_class, fields, kv, head_dim):
    """Norms inside attention (q_norm), Falcon's own fields and OPT's fc1/fc2 were miscounted, and
    head_dim was hidden/heads where the config sets its own."""
    from lmscope.analyses.probe import count_parameters
    from lmscope.catalog import kv_heads
    from lmscope.modeling.loading import model_info

    model = _built(config_class, **fields)
    totals, _ = count_parameters(model)
    by_class = sum(p.numel() for m in model.modules() if type(m).__name__.endswith(("LayerNorm", "RMSNorm"))
                   for p in m.parameters(recurse=False))
    assert totals["norms"] == by_class > 0
    assert totals["other"] == 0 and totals["mlp"] > 0 and totals["attention"] > 0
    assert sum(totals.values()) == sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())  # tied once
    info = model_info(model)
    assert (info["num_kv_heads"], info["head_dim"]) == (kv, head_dim)
    assert kv_heads(model.config.to_dict(), 4) == kv  # what registering the model's directory records
    # and the shapes say the same: the key projection has kv·head_dim outputs
    key_outputs = next(m.out_features for n, m in model.named_modules() if n.endswith(("k_proj", "query_key_value")))
    if config_class == "FalconConfig":
        assert key_outputs == (4 + 2 * kv) * head_dim  # fused q, k, v
    else:
        assert key_outputs == kv * head_dim


def test_a_prompt_that_quotes_special_tokens_is_read_as_text(tmp_path):
    """`<eos>` typed in a prompt is five bytes of text, not the end-of-sequence token: the loss is of
    the text the user wrote (byte tokenizer: one token per byte, plus <bos>)."""
    prompt = "the <eos> token and <pad>"
    out = run(ProbeParams(model="tiny-gpt2", prompt=prompt), LocalContext(tmp_path))
    assert out.summary["prompt_tokens"] == len(prompt.encode()) + 1


def test_parameters_of_a_layer_outside_attention_mlp_and_norms_are_drawn_and_counted(tmp_path):
    """Mamba's layers hold a mixer, neither attention nor MLP: its parameters are an "other" bar and series,
    and the per-layer groups add up to the layer's total."""
    transformers = need_module("transformers")
    from lmscope.analyses.base import LoadedModel
    from lmscope.modeling.loading import model_info
    from lmscope.modeling.tokenization import byte_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.MambaConfig(vocab_size=259, hidden_size=32, num_hidden_layers=2, state_size=4)).eval()
    ctx = LocalContext(tmp_path, models={"m": LoadedModel("m", model, byte_tokenizer(), model_info(model))})
    out = run(ProbeParams(model="m", prompt=PROMPT), ctx)
    groups = {s.labels["group"]: s.y for s in out.series if s.name == "parameters.by_layer"}
    assert set(groups) == {"attention", "mlp", "norms", "other", "total"}
    layer0 = dict(model.backbone.layers[0].named_parameters())
    assert groups["other"][0] == sum(p.numel() for n, p in layer0.items() if n.startswith("mixer.")) > 0
    parts = [sum(g[i] for name, g in groups.items() if name != "total") for i in range(2)]
    assert parts == groups["total"]


def test_a_prompt_loss_the_model_overflows_says_why_it_is_missing(tmp_path):
    """A float16 model whose activations pass 65504: the loss is not a number (stored as null), and the summary
    says why and what to change; the same model in float32 has a loss and no note."""
    from lmscope.analyses.base import LoadedModel
    from lmscope.modeling.loading import model_info

    lm = LocalContext(tmp_path).load_model("tiny-gpt2")
    with torch.no_grad():
        lm.model.get_input_embeddings().weight[:, 0] = 7e4
    fine = run(ProbeParams(model="m", prompt=PROMPT), LocalContext(tmp_path / "a", models={"m": lm})).summary
    assert math.isfinite(fine["prompt_loss"]) and "prompt_loss_note" not in fine
    half = LoadedModel("m", lm.model.half(), lm.tokenizer, model_info(lm.model))
    out = run(ProbeParams(model="m", prompt=PROMPT), LocalContext(tmp_path / "b", models={"m": half})).summary
    assert not math.isfinite(out["prompt_loss"]) and out["prompt_perplexity"] is None
    assert out["prompt_loss_note"] == ("the logits reach inf or NaN in float16 (the model's activations overflow; "
                                       "float16 stops at 65504: try bfloat16 or float32)")
