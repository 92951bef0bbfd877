"""Turn a registered model (built-in, HF directory or training checkpoint) into a model ready to run.

    lm = load_model("tiny-gpt2", "builtin", None)                 # random init, seed 0, byte tokenizer
    lm = load_model("gpt2", "directory", "/models/gpt2", dtype="bfloat16", device="cuda")
    lm.model(input_ids).logits

Nothing is downloaded: directories are read with ``local_files_only=True``. Models load in eval mode
with transformers' default attention: ``"sdpa"`` where the architecture has it, else ``"eager"`` (Bloom,
Gemma 2; GPT-J before transformers 5.24); analyses that need attention weights or the Triton kernels switch with
``lm.model.set_attn_implementation("eager")`` (or the kernels' registered implementation).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lmscope.catalog import (BUILTIN_MODELS, TOKENIZER_FILES, kv_heads, safetensors_parameter_count,
                             tokenizer_source, vocabulary_mismatch)
from lmscope.modeling.loaded import LoadedModel
from lmscope.modeling.memory import free_memory
from lmscope.modeling.tokenization import byte_tokenizer

__all__ = ["LoadedModel", "ModelCache", "ModelLoadError", "load_model", "load_tokenizer", "model_info", "max_positions",
           "builtin_config", "byte_tokenizer"]

# Loading bars belong in a terminal, not in worker logs.
transformers.utils.logging.disable_progress_bar()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUILTIN_SEED = 0


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message says what to change."""


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def builtin_config(name: str) -> transformers.PretrainedConfig:
    """The HF config of a built-in tiny model (``catalog.BUILTIN_MODELS``)."""
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(f"{name!r} is not a built-in model; built-ins: {', '.join(BUILTIN_MODELS)}")
    cfg = dict(BUILTIN_MODELS[name])
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def _load_builtin(name: str):
    config = builtin_config(name)
    # Fixed seed in a forked RNG: the same built-in is bit-identical on every worker, and the
    # caller's random stream is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_SEED)
        model = AutoModelForCausalLM.from_config(config)
    return model, byte_tokenizer()


def _load_tokenizer(path: Path, vocab_size: int | None):
    source = tokenizer_source(path, vocab_size)
    if source == "files":
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if source == "bytes":
        return byte_tokenizer()
    raise ModelLoadError(f"{path} has no tokenizer vocabulary ({' / '.join(TOKENIZER_FILES)}; tokenizer_config.json "
                         "alone holds none); save the tokenizer into the model directory with "
                         "tokenizer.save_pretrained(path)")


def load_tokenizer(source: str, path: str | None):
    """A registered model's tokenizer alone (``source`` as in :func:`load_model`), its weights left on disk."""
    if source == "builtin":
        return byte_tokenizer()
    if source not in ("directory", "checkpoint"):
        raise ModelLoadError(f"unknown model source {source!r}; use builtin, directory or checkpoint")
    p = Path(path)
    try:
        vocab_size = json.loads((p / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{p}/config.json cannot be read ({e})") from None
    return _load_tokenizer(p, vocab_size if isinstance(vocab_size, int) else None)


def check_vocabulary(model, tokenizer, where: str) -> None:
    """Refuse a tokenizer with more ids than the model has token embeddings (what registration could not
    see in the files: vocab.json, tokenizer.model, or files changed since)."""
    rows = model.get_input_embeddings().num_embeddings
    mismatch = vocabulary_mismatch(len(tokenizer) - 1, rows, f"the tokenizer ({len(tokenizer)} tokens)")
    if mismatch:
        raise ModelLoadError(f"{where}: {mismatch}")


def _weights_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes the weights will take in `dtype` (from safetensors headers; .bin files by their size)."""
    n = sum(safetensors_parameter_count(f) * dtype.itemsize for f in path.glob("*.safetensors"))
    return n + sum(f.stat().st_size for f in path.glob("*.bin"))


def _free_bytes(device: str) -> int:
    """Memory free to this process on CUDA ``device``."""
    target = torch.device(device)  # "cuda:1" is measured on GPU 1, not on the current device
    free, _ = torch.cuda.mem_get_info(target)
    # memory PyTorch's allocator holds but no tensor uses is free to this process too
    return free + torch.cuda.memory_reserved(target) - torch.cuda.memory_allocated(target)


def weights_fit(source: str, path: str | None, dtype: str, device: str) -> bool:
    """Whether a model's weights fit on ``device`` with room for activations (always, off CUDA and
    for the tiny built-ins)."""
    if source == "builtin" or not path or not device.startswith("cuda") or not torch.cuda.is_available():
        return True
    return _weights_bytes(Path(path), _torch_dtype(dtype)) <= 0.9 * _free_bytes(device)


def _load_directory(path: str | None, dtype: str, device: str):
    if not path:
        raise ModelLoadError("a directory or checkpoint model needs a path")
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p} has no config.json; it is not a Hugging Face model directory")
    # No attn_implementation: transformers picks sdpa where the architecture has it, else eager
    # (forcing "sdpa" refuses to load Bloom, Gemma 2, and GPT-J before transformers 5.24).
    # use_kernels=False: transformers >= 5.25 otherwise swaps layers' forwards for kernels fetched from the
    # Hub (network at load time; other numerics than the model's own code, which lmscope measures).
    kwargs: dict[str, Any] = dict(dtype=_torch_dtype(dtype), local_files_only=True, use_kernels=False)
    # Larger than the free GPU memory: let HF spread the layers over all visible GPUs (and CPU).
    # Needs the `accelerate` package; untested here (no GPU in CI).
    sharded = not weights_fit("directory", path, dtype, device)
    if sharded:
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
    except (ImportError, ValueError) as e:
        if not sharded:
            raise
        size = _weights_bytes(p, _torch_dtype(dtype)) / 2**30
        raise ModelLoadError(f"{p}: its weights ({size:.1f} GiB in {dtype}) do not fit in the free memory of "
                             f"{device} ({_free_bytes(device) / 2**30:.1f} GiB), and spreading them over the GPUs "
                             f"and the CPU failed: {e}") from None
    tokenizer = _load_tokenizer(p, getattr(model.config, "vocab_size", None))
    check_vocabulary(model, tokenizer, str(p))
    return model, tokenizer, sharded


def max_positions(config) -> int | None:
    """Positions a model reads at most (``max_position_embeddings``; GPT-2's ``n_positions``), None if unknown."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def config_head_dim(config) -> int | None:
    """Width of one attention head: the config's own head_dim (Qwen3, Gemma: not hidden_size / heads),
    else hidden_size / heads; None when the config says neither."""
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    return getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)


def model_info(model) -> dict[str, Any]:
    """Architecture facts of a loaded HF causal LM (the same keys as the models table)."""
    c = model.config
    heads = getattr(c, "num_attention_heads", None)
    seen: set[int] = set()
    num_parameters = 0
    for prm in model.parameters():  # tied weights (embedding = LM head) count once
        if id(prm) not in seen:
            seen.add(id(prm))
            num_parameters += prm.numel()
    return {
        "architecture": c.model_type,
        "num_layers": getattr(c, "num_hidden_layers", None),
        "num_heads": heads,
        "num_kv_heads": kv_heads(c.to_dict(), heads),
        "hidden_size": getattr(c, "hidden_size", None),
        "head_dim": config_head_dim(c),
        "vocab_size": getattr(c, "vocab_size", None),
        "num_parameters": num_parameters,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        # LLaMA-style MLP: down(act(gate(x)) * up(x)); Proposition 1 of the norms paper needs the plain one.
        "gated_ffn": any(n.endswith(("gate_proj", "gate_up_proj")) for n, _ in model.named_modules()),
        "max_positions": max_positions(c),
    }


# Buffers that stay float32 whatever the model's dtype: RoPE's inverse frequencies. from_pretrained(dtype=…)
# leaves them float32; a plain .to(bfloat16) would round them, turning position 4096 up to ~2 rad off.
FLOAT32_BUFFERS = ("inv_freq", "original_inv_freq")


def cast_model(model: torch.nn.Module, *, device: str | torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(device, dtype)`` that keeps the float32 buffers (``FLOAT32_BUFFERS``) float32."""
    keep = {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in FLOAT32_BUFFERS and b.dtype == torch.float32}
    model = model.to(device=device, dtype=dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buf.to(device))
    return model


def load_model(name: str, source: str, path: str | None, *, dtype: str = "float32",
               device: str = "cpu") -> LoadedModel:
    """Load a registered model: ``source`` is ``builtin``, ``directory`` or ``checkpoint``."""
    torch_dtype = _torch_dtype(dtype)
    sharded = False
    if source == "builtin":
        model, tokenizer = _load_builtin(name)
    elif source in ("directory", "checkpoint"):
        model, tokenizer, sharded = _load_directory(path, dtype, device)
    else:
        raise ModelLoadError(f"unknown model source {source!r}; use builtin, directory or checkpoint")
    if not sharded:
        model = cast_model(model, device=device, dtype=torch_dtype)
    model.eval()
    info = model_info(model)
    info["source"] = source
    info["device"] = device if not sharded else "auto"
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, info=info)


def files_changed_at(path: str | None) -> int | None:
    """The newest modification time (ns) of a model directory's config and weights, or None."""
    if path is None or not os.path.isdir(path):
        return None
    times = [entry.stat().st_mtime_ns for entry in os.scandir(path)
             if entry.is_file() and (entry.name == "config.json" or entry.name.endswith((".safetensors", ".bin")))]
    return max(times, default=None)


class ModelCache:
    """Keep the last ``capacity`` loaded models (LRU by name, dtype, device); thread-safe."""

    def __init__(self, capacity: int = 2):
        self.capacity = max(1, capacity)
        self._models: OrderedDict[tuple[str, str, str], LoadedModel] = OrderedDict()
        # where each cached model was read from, and when its files last changed: a name removed from the
        # registry and registered again (a run_name used a second time), or a checkpoint a retried run
        # rewrote, names other weights, which must not be served from the cache
        self._origins: dict[tuple[str, str, str], tuple] = {}
        self._lock = threading.Lock()
        # one per (name, dtype, device), held by the job using that model: jobs hook the model and switch its
        # attention, so two jobs in one process must not run it at once (see WorkerContext.load_model)
        self._in_use: dict[tuple[str, str, str], threading.Lock] = {}

    def use_lock(self, name: str, *, dtype: str = "float32", device: str = "cpu") -> threading.Lock:
        """The lock a job holds while it runs this cached model (never replaced, so every job sees the same)."""
        with self._lock:
            return self._in_use.setdefault((name, dtype, device), threading.Lock())

    def get(self, name: str, source: str, path: str | None, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
        key = (name, dtype, device)
        with self._lock:
            origin = (source, path, files_changed_at(path))
            if key in self._models and self._origins.get(key) != origin:
                self._evict(key)
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            # Make room before loading so two big models are never resident at once, and a model that
            # fits on the GPU once the cached ones are gone is not spread over devices beside them.
            while len(self._models) >= self.capacity:
                self._evict(next(iter(self._models)))
            while not weights_fit(source, path, dtype, device):
                same_device = [k for k in self._models if k[2] == device]  # others free nothing there
                if not same_device:
                    break
                self._evict(same_device[0])
            loaded = load_model(name, source, path, dtype=dtype, device=device)
            self._models[key] = loaded
            self._origins[key] = origin
            return loaded

    def forget(self, name: str) -> None:
        """Drop every cached copy of a model (e.g. after its row changed)."""
        with self._lock:
            for key in [k for k in self._models if k[0] == name]:
                del self._models[key]
                self._origins.pop(key, None)
            free_memory()

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, key: tuple[str, str, str]) -> bool:
        return key in self._models

    def _evict(self, key: tuple[str, str, str]) -> None:
        """Drop one cached model (the oldest first: the dict is in use order) and give its memory back."""
        del self._models[key]
        self._origins.pop(key, None)
        free_memory()


