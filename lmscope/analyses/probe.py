"""Job kind `probe`: load a model, count its parameters by part and layer, run one forward pass.

The service's smoke test: fast on CPU for the built-ins, and it exercises the whole path
(model row → worker cache → forward → series, plot, summary).

Parameter groups (tied weights counted once, under the module that owns them first):
  embeddings  token (and position) embeddings
  attention   q/k/v/o projections of every block (and their biases)
  mlp         the feed-forward network of every block
  norms       every LayerNorm / RMSNorm, inside the blocks and the final one
  head        the LM head; 0 when it is tied to the token embedding
  other       anything else (Mamba's mixer, a router, ...), per block where it sits
"""

from __future__ import annotations

import math
import re
import time

import torch
import torch.nn.functional as F

from lmscope.analyses.base import JobContext, JobFailed, JobOutput, Series, own_attention
from lmscope.analyses.plotting import pyplot, save
from lmscope.params.probe import ProbeParams

GROUPS = ("embeddings", "attention", "mlp", "norms", "head", "other")


def parameter_group(name: str) -> tuple[str, int | None]:
    """(group, layer index or None) of a parameter from its dotted name, e.g. ``model.layers.3.mlp.up_proj.weight``."""
    parts = name.split(".")
    layer = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if layer is not None:  # inside a block: the segment after the index says which part
        part = parts[layer + 1] if layer + 1 < len(parts) else ""
        index = int(parts[layer])
        modules = parts[layer + 1:-1]  # the modules between the block and the parameter
        # before "attn": post_attention_layernorm, a q_norm inside self_attn, Falcon's ln_attn are norms
        if any("norm" in m or m.startswith("ln") for m in modules):
            return "norms", index
        if "attn" in part or "attention" in part:
            return "attention", index
        if "mlp" in part or "ffn" in part or "feed_forward" in part or re.fullmatch(r"fc\d", part):  # OPT: fc1, fc2
            return "mlp", index
        return "other", index
    leaf = parts[-2] if len(parts) >= 2 else parts[0]
    if parts[0] in ("lm_head", "embed_out"):
        return "head", None
    if "norm" in leaf or leaf.startswith("ln"):
        return "norms", None
    if "embed" in leaf or leaf in ("wte", "wpe"):
        return "embeddings", None
    return "other", None


def count_parameters(model) -> tuple[dict[str, int], list[dict[str, int]]]:
    """Totals per group, and per layer the counts of each group (tied parameters once)."""
    totals = {g: 0 for g in GROUPS}
    num_layers = model.config.num_hidden_layers
    by_layer = [{g: 0 for g in GROUPS} for _ in range(num_layers)]
    for name, prm in model.named_parameters():  # named_parameters() skips the second name of a tied weight
        group, layer = parameter_group(name)
        totals[group] += prm.numel()
        if layer is not None and layer < num_layers:
            by_layer[layer][group] += prm.numel()
    return totals, by_layer


def _plot(path, model_name: str, by_layer: list[dict[str, int]], totals: dict[str, int]) -> None:
    layers = list(range(len(by_layer)))
    attention = [c["attention"] for c in by_layer]
    mlp = [c["mlp"] for c in by_layer]
    norms = [c["norms"] for c in by_layer]
    other = [c["other"] for c in by_layer]  # what a layer holds besides (Mamba's mixer, a router, ...)
    fig, ax = pyplot().subplots(figsize=(max(6.5, 0.35 * len(layers) + 3), 4.2))
    ax.bar(layers, attention, label="attention", color="tab:blue")
    ax.bar(layers, mlp, bottom=attention, label="MLP", color="tab:orange")
    ax.bar(layers, norms, bottom=[a + m for a, m in zip(attention, mlp)], label="norms", color="tab:gray")
    if any(other):
        ax.bar(layers, other, bottom=[a + m + n for a, m, n in zip(attention, mlp, norms)], label="other",
               color="tab:purple")
    ax.set_xticks(layers if len(layers) <= 32 else layers[:: math.ceil(len(layers) / 32)])
    ax.set_xlabel("layer")
    ax.set_ylabel("parameters")
    ax.set_ylim(0, 1.25 * max(sum(c.values()) for c in by_layer))  # headroom for the legend
    total = sum(totals.values())
    ax.set_title(f"{model_name}: parameters per layer\n(total {total:,}; embeddings {totals['embeddings']:,}; "
                 f"LM head {totals['head']:,}{' (tied)' if totals['head'] == 0 else ''})", fontsize=10)
    ax.legend(ncol=4 if any(other) else 3, loc="upper center")
    save(fig, path)


def run(params: ProbeParams, ctx: JobContext) -> JobOutput:
    with ctx.stage("load_model"):
        loaded = ctx.load_model(params.model, dtype=params.dtype)
    model, tokenizer, info = loaded.model, loaded.tokenizer, loaded.info
    ctx.progress(1, 3, "counting parameters")

    totals, by_layer = count_parameters(model)
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight

    ctx.progress(2, 3, "forward pass on the prompt")
    ids = tokenizer(params.prompt, return_tensors="pt", split_special_tokens=True)["input_ids"]  # text is text
    max_positions = info.get("max_positions")
    if max_positions:
        ids = ids[:, :max_positions]
    if ids.shape[1] < 2:
        raise JobFailed(f"the prompt encodes to {ids.shape[1]} token(s); give a prompt of at least 2 tokens "
                        "so there is a next token to predict")
    device = next(model.parameters()).device
    ids = ids.to(device)
    ctx.record("kernel_backend", own_attention(model))
    with ctx.stage("forward"), torch.no_grad():
        start = time.perf_counter()
        logits = model(input_ids=ids).logits.float()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the launches return before the GPU has finished
        forward_ms = 1000 * (time.perf_counter() - start)
    # Mean next-token cross-entropy: position t predicts token t+1.
    loss = F.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    next_token = tokenizer.decode([int(logits[0, -1].argmax())])

    ctx.progress(3, 3, "plotting")
    _plot(ctx.artifact_dir / "parameters.png", params.model, by_layer, totals)

    num_heads = info.get("num_heads")
    series = [
        Series("parameters.by_layer", list(range(len(by_layer))), [c[g] for c in by_layer], {"group": g})
        for g in ("attention", "mlp", "norms", "other") if g != "other" or any(c["other"] for c in by_layer)
    ]
    series.append(Series("parameters.by_layer", list(range(len(by_layer))),
                         [sum(c.values()) for c in by_layer], {"group": "total"}))
    summary = {
        "model": params.model,
        "architecture": info.get("architecture"),
        "num_layers": info.get("num_layers"),
        "num_heads": num_heads,
        "num_kv_heads": info.get("num_kv_heads"),
        "head_dim": info.get("head_dim"),
        "hidden_size": info.get("hidden_size"),
        "vocab_size": info.get("vocab_size"),
        "gated_ffn": info.get("gated_ffn"),
        "tied_embeddings": bool(tied),
        "num_parameters": sum(totals.values()),
        "parameters": {g: n for g, n in totals.items() if g != "other" or n},
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),  # as loaded, not as asked
        "device": str(device),
        "prompt_tokens": int(ids.shape[1]),
        "prompt_loss": loss,
        "prompt_perplexity": math.exp(min(loss, 700.0)) if math.isfinite(loss) else None,
        "next_token": next_token,
        "forward_ms": round(forward_ms, 3),
    }
    if not math.isfinite(loss):  # stored as null (and so is the perplexity), which alone would not say why
        summary["prompt_loss_note"] = (f"the logits reach inf or NaN in {summary['dtype']} (the model's activations "
                                       "overflow" + ("; float16 stops at 65504: try bfloat16 or float32)"
                                                     if summary["dtype"] == "float16" else ")"))
    return JobOutput(summary=summary, series=series)
