"""The benchmark shapes serve the demo tokenizer (``phloem serve --shape``): its ids must fit."""

from __future__ import annotations

import pytest

from phloem.runtime._default_model_tokenizer import train_tokenizer
from phloem.runtime.model_shapes import SHAPES


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_covers_the_demo_tokenizer(name: str) -> None:
    vocab = train_tokenizer().get_vocab_size()
    assert SHAPES[name]["vocab_size"] >= vocab, f"{name}: text would encode to ids past the vocabulary"
