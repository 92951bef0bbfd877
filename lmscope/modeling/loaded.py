"""What ``load_model`` returns: the model, its tokenizer and facts about it (no heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadedModel:
    """A model ready to run: HF causal LM, its tokenizer, and facts about it."""

    name: str
    model: Any  # transformers.PreTrainedModel, eval mode, on ctx.device
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    info: dict[str, Any] = field(default_factory=dict)
