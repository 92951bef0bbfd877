"""Run Hugging Face models' attention through :func:`attention_with_entropy`.

Registers the attention function ``"lmscope_entropy"`` with transformers' ``AttentionInterface``
(and the boolean sdpa-style mask builder under the same name with ``AttentionMaskInterface``, so
that pure-causal batches come with ``attention_mask=None`` and padded ones with a [B,1,N,N] bool
mask). Any model that dispatches through the interface (GPT-2, LLaMA, Mistral, Qwen2, …) then
computes its attention with the fused kernel; the per-layer entropies go to an active
:class:`EntropyCollector`::

    with EntropyCollector(model) as col:
        logits = model(input_ids, attention_mask=mask).logits
    col.entropy          # [ [B, H, N] float32 ] per layer, in layer order

Causal masks with key padding, sliding windows (Mistral, Gemma 2) and Gemma 2's logit soft-capping
run in the fused kernel; masks it cannot express (packed sequences, …) run on the reference path;
``col.backends`` lists what was used. Architectures whose
attention does not go through the interface (Falcon, Bloom, GPT-Neo, …; GPT-J before transformers 5.24) or that need what neither path
has (ALiBi and other additive biases, attention sinks) raise :class:`UnsupportedAttention`.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .attention_entropy import attention_with_entropy
from .attention_entropy.naive import attention_with_entropy_reference, visible_keys
from .dispatch import triton_available

ATTENTION_NAME = "lmscope_entropy"

# Collectors active in this thread / task (a worker thread and the API thread never share one).
_ACTIVE: contextvars.ContextVar[tuple[EntropyCollector, ...]] = contextvars.ContextVar("lmscope_collectors", default=())


def register_attention() -> str:
    """Register lmscope's attention (and its mask builder) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, lmscope_attention_forward)
    # The sdpa mask builder: None for plain causal batches, a bool [B, 1, Nq, Nk] mask otherwise.
    AttentionMaskInterface.register(ATTENTION_NAME, AttentionMaskInterface._global_mapping["sdpa"])
    # Asked now, before any forward: a compiled one (generate() with a static cache) that asked first
    # would guard on the unanswered check and compile again at its next call.
    triton_available()
    return ATTENTION_NAME


class UnsupportedAttention(NotImplementedError):
    """The model's attention cannot run through lmscope's attention function (the message says why)."""


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether ``model`` computes its attention through transformers' AttentionInterface, so that its
    attention implementation can be switched (False for Falcon, Bloom, GPT-Neo; GPT-J before transformers 5.24: docs/kernels.md). Models
    declare it; a bare module (one attention layer) reads its config, so it is taken to."""
    return getattr(model, "_supports_attention_backend", True) is not False


def _set_attn_implementation(model: torch.nn.Module, name: str) -> None:
    if not uses_attention_interface(model):
        raise UnsupportedAttention(
            f"{type(model).__name__} computes its attention itself instead of through transformers' "
            "AttentionInterface, so lmscope's attention function cannot run it")
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # a bare module (an attention layer): it reads the implementation from its config
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:
        raise UnsupportedAttention(f"{type(model).__name__} did not switch its attention to {name!r}")


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[torch.nn.Module]:
    """Switch ``model``'s attention implementation to ``name`` inside the block.

    The previous implementation is restored on exit, also when the block raises (models are often
    cached and shared). Raises :class:`UnsupportedAttention` for models that cannot switch.
    """
    previous = model.config._attn_implementation
    _set_attn_implementation(model, name)
    try:
        yield model
    finally:
        if previous is not None:
            _set_attn_implementation(model, previous)


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Eager attention inside the block: the route whose layers return their attention matrices.

    A model that computes attention in its own modules (Falcon) cannot switch through the interface, but
    it still builds its mask for the configured implementation: an sdpa (boolean) mask added to eager
    scores shifts them by 0 or 1 instead of hiding the future. So its config is switched for the block.
    """
    if uses_attention_interface(model):
        with attention_implementation(model, "eager"):
            yield model
        return
    previous = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        yield model
    finally:
        model.config._attn_implementation = previous


@contextlib.contextmanager
def lmscope_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model``'s attention through the fused kernel inside the block (no collecting)."""
    register_attention()
    with attention_implementation(model, ATTENTION_NAME):
        yield model


def lmscope_attention_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run its attention through lmscope's function, or None when it can.

    Tries a two-token forward pass: some limits (attention sinks, additive biases) only show there.
    """
    device = model.get_input_embeddings().weight.device
    try:
        with torch.no_grad(), EntropyCollector(model) as col:
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    except UnsupportedAttention as e:
        return str(e)
    if not col.layers:
        return f"no attention layer of {type(model).__name__} called transformers' AttentionInterface"
    return None


def use_lmscope_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` run its attention through the fused kernel from now on (no collecting).

    Returns the model. See :func:`lmscope_attention` for a switch that is undone afterwards.
    """
    register_attention()
    _set_attn_implementation(model, ATTENTION_NAME)
    return model


def _split_mask(
    mask: torch.Tensor, batch: int, nq: int, nk: int, window: int | None = None
) -> tuple[bool, torch.Tensor | None, torch.Tensor | None, int]:
    """Turn a 4-D HF mask into (causal, key_padding_mask, explicit_mask, keys).

    Boolean masks (True = attend) and additive masks (0 / very negative) are accepted. Only the first
    ``keys`` keys count: the trailing ones no query sees (a static cache's empty slots) are cut off.
    When the rest is "bottom-right causal AND key padding" (within the sliding ``window`` the layer
    declared, if any) or "key padding only", it is returned in that compact form; anything else comes
    back as an explicit bool mask for the reference path.
    """
    if mask.dtype != torch.bool:
        allowed = mask > torch.finfo(mask.dtype).min / 2
        if not bool(torch.all(torch.where(allowed, mask == 0, True))):
            raise UnsupportedAttention("additive attention biases (ALiBi, relative positions) are not supported")
        mask = allowed
    if mask.ndim != 4 or mask.shape[-2:] != (nq, nk):
        raise ValueError(f"unexpected attention mask shape {tuple(mask.shape)} for Nq={nq}, Nk={nk}")
    seen = mask.any(dim=(0, 1, 2))
    if bool(seen.any()):
        nk = int(seen.nonzero().max()) + 1
        mask = mask[..., :nk]
    if mask.shape[1] != 1:
        return False, None, mask, nk
    m = mask[:, 0].expand(batch, nq, nk)
    # A key is unpadded iff some query sees it (the last one does under causal). Under a window,
    # keys left of every window count as padded, which changes nothing: no query sees them.
    kpm = m.any(dim=1)
    causal_band = visible_keys(nq, nk, causal=True, window=window, device=m.device)[0]
    if torch.equal(m, causal_band & kpm[:, None, :]):
        causal = True
    elif window is None and torch.equal(m, kpm[:, None, :].expand_as(m)):
        causal = False
    else:
        return False, None, mask, nk
    return causal, (None if bool(kpm.all()) else kpm), None, nk


# transformers builds one mask per forward pass (one per kind of layer) and hands the same tensor to
# every layer: read it once, not once per layer (each reading is several host syncs and passes over
# [B, 1, Nq, Nk]). Entries hold the mask weakly and are keyed by its version counter, so a freed or
# modified mask is read again; only compact results (a [B, Nk] padding mask) are kept.
_SPLIT_MASKS: list[tuple[weakref.ref, tuple, tuple]] = []


def _split_mask_once(mask: torch.Tensor, batch: int, nq: int, nk: int, window: int | None):
    """``_split_mask``, remembered for the last few masks seen.

    Not for inference tensors (``torch.inference_mode``): they have no version counter. (A mask changed
    through ``.data`` or a shared numpy view keeps its version: transformers never does that.)"""
    if mask.is_inference():
        return _split_mask(mask, batch, nq, nk, window)
    key = (mask._version, batch, nq, nk, window)
    for ref, seen_key, result in list(_SPLIT_MASKS):
        if ref() is mask and seen_key == key:
            return result
    result = _split_mask(mask, batch, nq, nk, window)
    if result[2] is None:  # an explicit mask (a view of this one) is not worth keeping alive
        _SPLIT_MASKS[:] = [e for e in _SPLIT_MASKS if e[0]() is not None][-3:] + [(weakref.ref(mask), key, result)]
    return result


def lmscope_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B,H,N,D], k/v [B,H_kv,N,D] → ([B,N,H,Dv], None)."""
    if dropout and module.training:
        raise ValueError("lmscope attention has no attention dropout; call model.eval() first")
    for name in ("s_aux", "position_bias"):  # attention sinks, T5-style relative biases
        if kwargs.get(name) is not None:
            raise UnsupportedAttention(f"lmscope attention does not support {name!r}")
    softcap = kwargs.get("softcap") or None  # 0 / None: no cap
    collectors = [c for c in _ACTIVE.get() if c._owns(module)]
    backend = collectors[-1].backend if collectors else None

    if not (query.dtype == key.dtype == value.dtype):
        # under autocast, RoPE can hand over fp32 q, k with a bf16 v: attend in the value's dtype, as sdpa would
        query, key = query.to(value.dtype), key.to(value.dtype)
    b, _, nq, _ = query.shape
    nk = key.shape[2]
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    window = None
    if attention_mask is None:
        # No mask means what it means to sdpa: is_causal for more than one query, aligned top-left. A
        # static cache's prefill comes so, its Nk − Nq trailing slots still empty: query i sees keys 0..i.
        causal, kpm, explicit = bool(is_causal) and nq > 1, None, None
        if causal and nk > nq:
            key, value = key[:, :, :nq], value[:, :, :nq]
    else:
        # transformers hands no mask when the window covers every key (the sdpa mask builder skips it)
        window = kwargs.get("sliding_window")
        window = int(window) if window is not None and is_causal and nk > window else None
        causal, kpm, explicit, keys = _split_mask_once(attention_mask, b, nq, nk, window)
        if keys < nk:
            key, value = key[:, :, :keys], value[:, :, :keys]

    if explicit is None:
        res = attention_with_entropy(query, key, value, causal=causal, scale=scaling, key_padding_mask=kpm,
                                     softcap=softcap, window=window,
                                     backend=backend)
        out, ent, lse, used = res.out, res.entropy, res.lse, res.backend
    else:
        out, ent, lse = attention_with_entropy_reference(query, key, value, causal=False, scale=scaling,
                                                         attn_mask=explicit, softcap=softcap)
        used = "reference"
    for col in collectors:
        col._record(module, ent, lse, (query, key, value), used, scaling=scaling,
                    sliding_window=kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None


class EntropyCollector:
    """Context manager: run ``model`` through lmscope attention and keep each layer's entropies.

    Inside the ``with`` block the model's attention implementation is ``"lmscope_entropy"``; the
    previous one is restored on exit. After a forward pass:

    - ``entropy``: list over layers of [B, H, N] float32 row entropies (nats). Rows with no visible
      key (e.g. left-padding queries) are 0; mask padded query positions out before averaging.
    - ``lse``: the same for the log-sum-exp of each row.
    - ``qkv`` (with ``capture_qkv=True``): {layer: (q, k, v)}, [B, H, N, D] after RoPE, detached;
      k and v keep the model's H_kv heads (grouped-query models). ``to_cpu=True`` moves them (and
      the entropies) to the CPU as they arrive, to bound GPU memory.
    - ``backends``: the set of backends that ran ("triton", "reference").
    - ``scaling``: {layer: the softmax scale the layer used}, i.e. the module's own ``scaling``
      (1/√D, or e.g. GPT-2's 1/(√D·(layer+1)) with ``scale_attn_by_inverse_layer_idx``); 1/√D when
      the model passed none.
    - ``sliding_window``: {layer: window} for layers that asked for a sliding-window mask (Mistral,
      Qwen2 with ``use_sliding_window``): query t then sees keys max(0, t − window + 1)..t.

    A later forward pass inside the same block overwrites the layers it runs; ``clear()`` empties.
    Layers are keyed by the attention module's ``layer_idx`` (else by order of first call).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        capture_qkv: bool = False,
        to_cpu: bool = False,
        backend: str | None = None,
    ):
        self.model = model
        self.capture_qkv = capture_qkv
        self.to_cpu = to_cpu
        self.backend = backend
        self._modules: set[int] = set()
        self._order: dict[int, int] = {}
        self._entropy: dict[int, torch.Tensor] = {}
        self._lse: dict[int, torch.Tensor] = {}
        self.qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.backends: set[str] = set()
        self.scaling: dict[int, float] = {}
        self.sliding_window: dict[int, int] = {}
        self._switch: contextlib.AbstractContextManager | None = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> EntropyCollector:
        self._modules = {id(m) for m in self.model.modules()}
        switch = lmscope_attention(self.model)
        switch.__enter__()
        self._switch = switch
        self._token = _ACTIVE.set(_ACTIVE.get() + (self,))
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)
        self._token = None
        switch, self._switch = self._switch, None
        switch.__exit__(*exc)

    def _owns(self, module: torch.nn.Module) -> bool:
        return id(module) in self._modules

    def _record(self, module, ent, lse, qkv, backend, *, scaling: float | None = None,
                sliding_window: int | None = None) -> None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = self._order.setdefault(id(module), len(self._order))
        move = (lambda t: t.detach().cpu()) if self.to_cpu else (lambda t: t.detach())
        self._entropy[layer] = move(ent)
        self._lse[layer] = move(lse)
        if self.capture_qkv:
            self.qkv[layer] = tuple(move(t) for t in qkv)
        self.backends.add(backend)
        # The scale attention_with_entropy applied (its default is 1/√D when the model passes none).
        self.scaling[layer] = float(scaling) if scaling is not None else qkv[0].shape[-1] ** -0.5
        if sliding_window is not None:
            self.sliding_window[layer] = int(sliding_window)

    @property
    def layers(self) -> list[int]:
        return sorted(self._entropy)

    @property
    def entropy(self) -> list[torch.Tensor]:
        return [self._entropy[i] for i in self.layers]

    @property
    def lse(self) -> list[torch.Tensor]:
        return [self._lse[i] for i in self.layers]

    def clear(self) -> None:
        self._entropy.clear()
        self._lse.clear()
        self.qkv.clear()
        self.backends.clear()
        self.scaling.clear()
        self.sliding_window.clear()


__all__ = [
    "ATTENTION_NAME",
    "EntropyCollector",
    "UnsupportedAttention",
    "attention_implementation",
    "lmscope_attention",
    "lmscope_attention_unsupported",
    "lmscope_attention_forward",
    "register_attention",
    "use_lmscope_attention",
    "uses_attention_interface",
]
