"""Models and datasets as the API sees them: light checks and facts, no torch.

Both the API (registration, upload, listing) and the workers (reading documents) use this module,
so a dataset means the same documents on both sides.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmscope import strict_json

# Built-in random-init models for tests and demos; they use a byte-level tokenizer (256 bytes + BOS/EOS/PAD).
BYTE_VOCAB_SIZE = 259
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-gpt2": {
        "model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 64, "n_positions": 1024,
        "vocab_size": BYTE_VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": 257,
    },
    "tiny-llama": {
        "model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 64, "intermediate_size": 176, "max_position_embeddings": 1024,
        "vocab_size": BYTE_VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
    },
}

# Each is tested in tests/analyses/test_architectures.py: norms and entropy on a tiny random-init model.
SUPPORTED_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "cohere": "CohereForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi": "PhiForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    # attention computed in their own modules: entropy reads their attention matrices (docs/kernels.md);
    # GPT-J too before transformers 5.24, which moved it onto the AttentionInterface
    "falcon": "FalconForCausalLM",
    "gptj": "GPTJForCausalLM",
    "bloom": "BloomForCausalLM",
}


# Architectures whose q, k, v lmscope's attention function never sees (attention in their own modules),
# and those whose attention is not a plain softmax of q·k (Gemma 2 soft-caps the scores): the attention
# study cannot compare them with their own attention, and is refused at submit. GPT-J is not listed: since
# transformers 5.24 (what a worker image installs) it goes through the AttentionInterface; a worker on an
# older transformers (the GPU test image's 5.17) refuses it when the job starts, from the model itself.
# Falcon stays listed: its code calls the interface from transformers 5.25 on, but its class does not declare
# so (`_supports_attention_backend`), and lmscope goes by the declaration (lmscope.kernels.hf).
OWN_ATTENTION_MODULES = ("falcon", "bloom")
SOFT_CAPPED_ATTENTION = ("gemma2",)


class CatalogError(ValueError):
    """A model directory or dataset file that cannot be used; the message says what to change."""


# Names of models and datasets: safe in URLs, file names and `@step<N>` suffixes.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@:+/-]*$"
NAME_MAX_LENGTH = 200


def name_rule(max_length: int = NAME_MAX_LENGTH) -> str:
    return f"use at most {max_length} letters, digits and . _ @ : + / -, starting with a letter or digit"


NAME_RULE = name_rule()


def check_name(name: str, *, max_length: int = NAME_MAX_LENGTH, what: str = "a name") -> None:
    """Raise CatalogError unless `name` may name a model or dataset (or, with `what`, something else)."""
    if not re.fullmatch(NAME_PATTERN, name) or len(name) > max_length:
        raise CatalogError(f"{name!r} cannot be {what}: {name_rule(max_length)}")


@dataclass
class ModelFacts:
    architecture: str
    num_layers: int | None
    num_heads: int | None
    num_kv_heads: int | None
    hidden_size: int | None
    vocab_size: int | None
    num_parameters: int | None
    dtype: str | None
    info: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # the resolved directory (inspect_model_dir)


# INTEGER columns are 32-bit in PostgreSQL: job ids, model facts and per-user limits stay within this.
INT32_MAX = 2**31 - 1
# The facts live in INTEGER columns; the parameter count in a BIGINT.
MAX_FACT = INT32_MAX
MAX_PARAMETERS = 2**63 - 1


def config_facts(config: dict[str, Any]) -> ModelFacts:
    """Layers, heads, width from a HF config dict, whatever the architecture calls them.

    CatalogError names a field whose value cannot be one of these facts (not a positive integer,
    a dtype that is not a short name): stored, it would be served as nonsense (or as invalid JSON).
    """
    if not isinstance(config, dict):
        raise CatalogError(f"config.json must hold a JSON object, not {type(config).__name__}")

    def first(*keys):
        for k in keys:
            value = config.get(k)
            if value is None:
                continue
            if type(value) is not int or not 1 <= value <= MAX_FACT:
                raise CatalogError(f"config.json: {k} must be a positive integer (at most {MAX_FACT}), "
                                   f"not {json.dumps(value)[:60]}")
            return value
        return None

    def dtype_name():
        for k in ("torch_dtype", "dtype"):
            value = config.get(k)
            if value is None:
                continue
            if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.]{1,16}", value):
                raise CatalogError(f"config.json: {k} must name a dtype like \"bfloat16\", "
                                   f"not {json.dumps(value)[:60]}")
            return value
        return None

    architecture = config.get("model_type", "unknown")
    if not isinstance(architecture, str) or len(architecture) > 64:
        raise CatalogError(f"config.json: model_type must be a name like \"gpt2\", not {json.dumps(architecture)[:60]}")
    heads = first("num_attention_heads", "n_head")
    positions = first("max_position_embeddings", "n_positions")
    info: dict[str, Any] = {"max_positions": positions} if positions else {}
    if architecture in SOFT_CAPPED_ATTENTION:  # absent from the file: the config class's default caps
        cap = config.get("attn_logit_softcapping", "default")
        info["attention_softcap"] = bool(cap) if isinstance(cap, (int, float, type(None))) else True
    return ModelFacts(
        architecture=architecture,
        num_layers=first("num_hidden_layers", "n_layer"),
        num_heads=heads,
        num_kv_heads=kv_heads(config, heads, read=first),
        hidden_size=first("hidden_size", "n_embd"),
        vocab_size=first("vocab_size"),
        num_parameters=None,
        dtype=dtype_name(),
        # Kept so that a submit asking for more positions than the model reads, or an attention study of
        # soft-capped attention, is refused at once.
        info=info,
    )


def builtin_parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a built-in GPT-2 or LLaMA config, counted from its shapes (the API has no torch).

    Tied weights count once, as ``model.parameters()`` does: GPT-2 ties its LM head to the embedding.
    """
    V = config["vocab_size"]
    if config["model_type"] == "gpt2":
        E, L, P = config["n_embd"], config["n_layer"], config["n_positions"]
        inner = config.get("n_inner") or 4 * E
        block = (2 * E                    # ln_1
                 + E * 3 * E + 3 * E      # c_attn (q, k, v)
                 + E * E + E              # attn c_proj
                 + 2 * E                  # ln_2
                 + E * inner + inner      # mlp c_fc
                 + inner * E + E)         # mlp c_proj
        return V * E + P * E + L * block + 2 * E  # wte, wpe, blocks, ln_f
    if config["model_type"] == "llama":
        E, L, I = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
        H = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or H
        hd = config.get("head_dim") or E // H
        block = (E * H * hd + 2 * E * kv * hd + H * hd * E  # q, k, v, o (no biases)
                 + 3 * E * I                                # gate, up, down
                 + 2 * E)                                   # two RMSNorms
        head = 0 if config.get("tie_word_embeddings") else V * E
        return V * E + L * block + E + head  # embed, blocks, final norm, LM head
    raise ValueError(f"no parameter count for model_type {config['model_type']!r}")


SAFETENSORS_MAX_HEADER = 100_000_000  # the format's own limit


def safetensors_parameter_count(path: Path) -> int:
    """Number of parameters in a .safetensors file, read from its JSON header only.

    CatalogError when the file is not one (too short, a header length past its end, a header that is
    not a JSON object of tensors with shapes).
    """
    path = Path(path)

    def not_safetensors(why: str) -> CatalogError:
        return CatalogError(f"{path.name} is not a safetensors file: {why}")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise not_safetensors(f"it is {len(head)} bytes long")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(os.fstat(f.fileno()).st_size - 8, SAFETENSORS_MAX_HEADER):
            raise not_safetensors(f"its header length ({header_len} bytes) runs past the end of the file")
        try:
            header = strict_json.loads(f.read(header_len))
        except strict_json.StrictJsonError as e:
            raise not_safetensors(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise not_safetensors("its header is not a JSON object")
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise not_safetensors(f"tensor {name!r} has no shape (a list of sizes)")
        total += math.prod(shape)
    return total


# The files a Hugging Face tokenizer's vocabulary loads from (tokenizer_config.json alone holds none):
# tokenizers' JSON, GPT-2's BPE vocabulary, WordPiece's, SentencePiece models under their usual names.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
# A directory without tokenizer files may name lmscope's byte tokenizer here: {"tokenizer": "bytes"}.
LMSCOPE_MANIFEST = "lmscope.json"


def tokenizer_source(path: Path, vocab_size: int | None) -> str | None:
    """How a model directory's tokenizer loads: "files" (Hugging Face's, saved beside the weights),
    "bytes" (lmscope's byte tokenizer: named in lmscope.json, or implied by the byte vocabulary, as in
    a training run's checkpoints), or None: there is none."""
    try:
        named = json.loads((path / LMSCOPE_MANIFEST).read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):  # no manifest, or not a JSON object
        named = None
    if named == "bytes":
        return "bytes"
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        return "files"
    return "bytes" if vocab_size == BYTE_VOCAB_SIZE else None


def largest_token_id(path: Path, source: str | None) -> int | None:
    """The largest id a model directory's tokenizer can produce, as far as its files say without loading
    it: the byte tokenizer's, or tokenizer.json's vocabulary and added tokens. None when unknown
    (vocab.json / tokenizer.model only, or a file this reader does not follow)."""
    if source == "bytes":
        return BYTE_VOCAB_SIZE - 1
    try:
        tok = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = tok["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else range(len(vocab))  # BPE/WordPiece, Unigram
        ids = [*ids, *(t["id"] for t in tok.get("added_tokens") or [])]
        return max(i for i in ids if type(i) is int) if ids else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def vocabulary_mismatch(largest_id: int | None, embedding_rows: int | None, what: str) -> str | None:
    """Why a tokenizer whose ids reach ``largest_id`` cannot feed a model with ``embedding_rows`` token
    embeddings (an id past them fails every job with an index error), or None."""
    if largest_id is None or embedding_rows is None or largest_id < embedding_rows:
        return None
    return (f"{what} produces token ids up to {largest_id}, but the model has {embedding_rows} token embeddings "
            f"(vocab_size): ids from {embedding_rows} on would index past them. Save the tokenizer the model was "
            "trained with into its directory, or resize the model to the tokenizer "
            "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) and train it")


def kv_heads(config: dict, heads: int | None, read=None) -> int | None:
    """Key/value heads of a config (a dict): num_key_value_heads, or Falcon's own fields (as transformers
    reads them: num_kv_heads with new_decoder_architecture or without multi_query, else one); else as
    many as query heads. ``read(key)``: how a field is read (``config_facts`` refuses a bad value);
    by default a value that is not a positive integer counts as absent."""
    def count(key):
        value = config.get(key)
        return value if type(value) is int and 1 <= value <= MAX_FACT else None

    read = read or count
    if config.get("model_type") == "falcon":
        if config.get("new_decoder_architecture") or not config.get("multi_query", True):
            return read("num_kv_heads") or heads
        return 1
    return read("num_key_value_heads") or heads


def inspect_model_dir(path: Path, roots: list[Path]) -> ModelFacts:
    """Check that `path` is a causal-LM Hugging Face directory under one of `roots`; return its facts.

    Symlinks are resolved before the check, so a link inside a root that points outside is refused. A relative
    path is looked up under each root in turn (the server's working directory means nothing to its users).
    """
    if not roots:
        raise CatalogError("no model roots are configured on the server: start it (`lmscope up`, or the API and "
                           "workers) with LMSCOPE_MODEL_DIRS set to the directories models may live in")

    def inside(p: Path) -> bool:
        return any(p == r.resolve() or p.is_relative_to(r.resolve()) for r in roots)

    outside = CatalogError(f"{path} is outside the configured model roots ({', '.join(map(str, roots))}); "
                           "put the model under one of them or add its parent to LMSCOPE_MODEL_DIRS")
    try:
        given = Path(path).expanduser()
        if given.is_absolute():
            resolved = given.resolve()
        else:  # only what stays inside a root is looked at: whether a path outside exists is never said
            kept = [c for c in ((Path(r) / given).resolve() for r in roots) if inside(c)]
            if not kept:
                raise outside
            resolved = next((c for c in kept if c.exists()), None)
            if resolved is None:
                raise CatalogError(f"{path} is a relative path and no model root holds it (looked for "
                                   f"{', '.join(map(str, kept))}); give the directory's absolute path on the "
                                   "server, or its path under one of the roots")
    except CatalogError:
        raise
    except (RuntimeError, ValueError, OSError) as e:  # ~nosuchuser, a NUL byte, a symlink loop
        raise CatalogError(f"{path} is not a usable path ({e}); give the directory's absolute path") from None
    if not inside(resolved):
        raise outside
    if not resolved.is_dir():
        raise CatalogError(f"{path} is not a directory; give the Hugging Face model directory (with config.json)")
    cfg_path = resolved / "config.json"
    if not cfg_path.is_file():
        raise CatalogError(f"{path} has no config.json; it is not a Hugging Face model directory")
    try:
        config = strict_json.loads(cfg_path.read_bytes())
    except OSError as e:
        raise CatalogError(f"cannot read {cfg_path}: {e.strerror}") from None
    except strict_json.StrictJsonError as e:
        raise CatalogError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CatalogError(f"{cfg_path} must hold a JSON object (a Hugging Face config), not {type(config).__name__}")
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
        raise CatalogError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CatalogError(f"{cfg_path}: architectures must be a list of class names like [\"GPT2LMHeadModel\"]")
    if archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        raise CatalogError(f"{path} is not a causal language model (architectures: {archs}); lmscope analyses causal LMs")
    weights = sorted(resolved.glob("*.safetensors")) + sorted(resolved.glob("*.bin"))
    if not weights:
        raise CatalogError(f"{path} has no weights (*.safetensors or *.bin)")
    facts = config_facts(config)
    facts.path = str(resolved)
    source = tokenizer_source(resolved, facts.vocab_size)
    if source is None:
        raise CatalogError(f"{path} has no tokenizer vocabulary ({' / '.join(TOKENIZER_FILES)}; tokenizer_config.json "
                           "alone holds none); save it into the model directory with tokenizer.save_pretrained(path), "
                           "or, for a model trained on bytes, write {\"tokenizer\": \"bytes\"} into lmscope.json there")
    what = "lmscope's byte tokenizer" if source == "bytes" else "its tokenizer.json"
    mismatch = vocabulary_mismatch(largest_token_id(resolved, source), facts.vocab_size, what)
    if mismatch:
        raise CatalogError(f"{path}: {mismatch}")
    st = [w for w in weights if w.suffix == ".safetensors"]
    if st:
        try:
            facts.num_parameters = sum(safetensors_parameter_count(w) for w in st)
        except OSError as e:
            raise CatalogError(f"cannot read {e.filename}: {e.strerror}") from None
        if facts.num_parameters > MAX_PARAMETERS:
            raise CatalogError(f"{path}: the safetensors headers claim {facts.num_parameters} parameters; "
                               "they are not a real model's")
    return facts


# ---------------------------------------------------------------- datasets

_HEADING = re.compile(r"^\s*(=\s)+.*(\s=)+\s*$")


DATASET_FORMATS = {
    "text": "plain text; documents are paragraphs separated by blank lines",
    "lines": "plain text; every non-empty line is a document (WikiText's raw files)",
    "jsonl": 'one JSON object per line with a string field "text"',
}


def split_documents(text: str, fmt: str = "text") -> list[str]:
    """Plain text → documents (paragraphs or lines); WikiText headings (` = T = `) are dropped."""
    text = text.replace("\r\n", "\n")
    blocks = text.split("\n") if fmt == "lines" else re.split(r"\n\s*\n", text)
    docs = []
    for block in blocks:
        block = block.strip()
        if block and not _HEADING.match(block):
            docs.append(block)
    return docs


def parse_documents(data: bytes, fmt: str) -> list[str]:
    """Decode an upload (UTF-8) into documents; CatalogError says where decoding failed."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise CatalogError(f"the file is not UTF-8: byte {e.start} (line {line}) is {data[e.start:e.start + 1]!r}; "
                           "re-encode it as UTF-8") from None
    if fmt in ("text", "lines"):
        return split_documents(text, fmt)
    if fmt == "jsonl":
        return _jsonl_documents(text)
    raise CatalogError(f"unknown format {fmt!r}; use one of: {', '.join(DATASET_FORMATS)}")


def _jsonl_documents(text: str) -> list[str]:
    like = 'each line must be an object like {"text": "..."}'
    docs = []
    # Lines end at \n only: JSON strings may hold U+2028 and friends, which str.splitlines() splits on.
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = strict_json.loads(line)
        except strict_json.StrictJsonError as e:
            raise CatalogError(f"line {i} is not JSON ({e}); {like}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CatalogError(f"line {i} has no string field 'text'; {like}")
        try:
            obj["text"].encode("utf-8")
        except UnicodeEncodeError as e:  # "\ud800": valid JSON, but no character a tokenizer can read
            raise CatalogError(f"line {i}: its text holds a lone surrogate ({obj['text'][e.start]!r} at character "
                               f"{e.start}); write the character itself, or a surrogate pair") from None
        if obj["text"].strip():
            docs.append(obj["text"])
    return docs


def read_documents(path: Path, fmt: str) -> list[str]:
    return parse_documents(Path(path).read_bytes(), fmt)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
