"""The tiny model's tokenizer, shared by the examples' unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
