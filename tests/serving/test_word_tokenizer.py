"""`WordTokenizer`: one id per word, round trip, and refusals that name the bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.serving.tokenizer import WordTokenizer

WORDS = ["Hello", "world", "how", "are", "you"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(WORDS), max_size=12))
def test_round_trip_and_ids(words):
    tok = WordTokenizer(WORDS)
    ids = tok.encode(" ".join(words))
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.tolist() == [WORDS.index(w) for w in words]
    assert tok.decode(ids) == " ".join(words)
    assert tok.decode(ids.tolist()) == " ".join(words)


def test_refusals_name_the_input():
    tok = WordTokenizer(WORDS)
    with pytest.raises(ValueError, match="'there'"):
        tok.encode("Hello there")
    with pytest.raises(ValueError, match=r"\[7\]"):
        tok.decode([0, 7])
    with pytest.raises(TypeError, match="text"):
        tok.encode(3)
    with pytest.raises(ValueError, match="distinct"):
        WordTokenizer(["a", "a"])
    with pytest.raises(ValueError, match=r"words\[1\]"):
        WordTokenizer(["a", "b c"])
    with pytest.raises(TypeError, match="iterable"):
        WordTokenizer("Hello world")
    assert tok.vocab_size == 5 and tok.vocab["you"] == 4
