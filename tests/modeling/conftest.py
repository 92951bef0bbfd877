"""Fixtures for the modeling / train / probe tests: real WikiText text, one CPU thread.

One thread: on a shared 2-core machine, two OpenMP threads per process spin against each other and
make small-model training 5–20× slower; the numbers do not depend on it.
"""

from __future__ import annotations


import pytest
import torch

from lmscope.catalog import read_documents
from lmscope.config import Settings

WIKITEXT = Settings.from_env().wikitext2_path  # the shared copy beside the checkout, else data/ (config.py)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def wikitext_docs() -> list[str]:
    """WikiText-2 (raw test split) documents, one per line, headings dropped."""
    return read_documents(WIKITEXT, "lines")
