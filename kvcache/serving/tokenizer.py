"""`ByteTokenizer`: the smallest real tokenizer, one token per UTF-8 byte; `WordTokenizer`: one
token per word of a tiny fixed vocabulary, for trees whose nodes read as words.

Enough for the book's examples: token ids are the bytes of the text (0..255), so a prefix of
the text is a prefix of the ids and a reader can see what a radix-tree node holds. A node's key
may end in the middle of a multi-byte character; `decode` then shows the stray bytes escaped
(``\\xe4``) instead of failing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._validate import as_int, as_list, check_token_ids

__all__ = ["ByteTokenizer", "WordTokenizer"]

_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _token_values(ids: torch.Tensor | Iterable[int]) -> list[int]:
    """``ids`` (a 1-D integer tensor or an iterable of integers) as Python ints; ``TypeError``
    for text or non-integers (``65.9`` is not ``65``)."""
    if isinstance(ids, torch.Tensor):
        values: list[int] = check_token_ids(ids, "ids").tolist()
        return values
    if isinstance(ids, (str, bytes, bytearray)):
        raise TypeError(f"ids must be token ids (a tensor or integers), got {type(ids).__name__}")
    items = as_list(ids, "ids", "token ids (a tensor or integers)")
    return [as_int(v, f"ids[{i}]") for i, v in enumerate(items)]


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary of 256).

    Promises: ``decode(encode(s)) == s`` for any printable ``s``; ``encode`` returns a 1-D CPU
    ``int64`` tensor; ``decode`` never raises on ids in ``0..255`` and returns a single line
    (control characters and undecodable bytes are shown as escapes).
    """

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """The UTF-8 bytes of ``text`` as a 1-D ``int64`` tensor."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. "\ud800"
            raise ValueError(f"text must be encodable as UTF-8: {e}") from None
        return torch.tensor(list(data), dtype=torch.int64)

    def decode(self, ids: torch.Tensor | Iterable[int]) -> str:
        """Text of ``ids`` (bytes 0..255); non-printable characters and broken UTF-8 escaped.

        ``ids``: a 1-D integer CPU tensor or an iterable of integers (Python, NumPy or 0-d torch
        integers); ``TypeError`` for anything else (``65.9`` is not ``65``), ``ValueError`` out of range.
        """
        values = _token_values(ids)
        bad = [v for v in values if not 0 <= v <= 255]
        if bad:
            raise ValueError(f"byte token ids must be in [0, 255], got {bad[:4]}")
        text = bytes(values).decode("utf-8", errors="backslashreplace")
        return "".join(
            ch
            if ch.isprintable()
            else _ESCAPES.get(ch, ch.encode("unicode_escape").decode("ascii"))
            for ch in text
        )

    def __call__(self, text: str) -> torch.Tensor:
        return self.encode(text)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class WordTokenizer:
    """One token per word of a fixed vocabulary: ``words[i]`` has id ``i``.

    The book's small trees use it so that every node shows whole words (``"Hello world"``).
    Promises: ``encode`` returns a 1-D CPU ``int64`` tensor, one id per whitespace-separated word,
    and ``decode(encode(s)) == " ".join(s.split())``. ``ValueError`` names an unknown word or id.
    """

    def __init__(self, words: Iterable[str]) -> None:
        if isinstance(words, str):
            raise TypeError("words must be an iterable of words, not one str")
        words = list(words)
        for i, w in enumerate(words):
            if not isinstance(w, str) or not w or w.split() != [w]:
                raise ValueError(f"words[{i}] must be a non-empty word without spaces, got {w!r}")
        if len(set(words)) != len(words):
            raise ValueError(f"words must be distinct, got {words}")
        self.words = words
        self.vocab = {w: i for i, w in enumerate(words)}

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> torch.Tensor:
        """The ids of the words of ``text`` as a 1-D ``int64`` tensor."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        unknown = [w for w in text.split() if w not in self.vocab]
        if unknown:
            raise ValueError(f"words not in the vocabulary: {unknown[:4]} (it has {self.words})")
        return torch.tensor([self.vocab[w] for w in text.split()], dtype=torch.int64)

    def decode(self, ids: torch.Tensor | Iterable[int]) -> str:
        """The words of ``ids``, joined by single spaces."""
        values = _token_values(ids)
        bad = [v for v in values if not 0 <= v < len(self.words)]
        if bad:
            raise ValueError(f"word ids must be in [0, {len(self.words) - 1}], got {bad[:4]}")
        return " ".join(self.words[v] for v in values)

    def __call__(self, text: str) -> torch.Tensor:
        return self.encode(text)

    def __repr__(self) -> str:
        return f"WordTokenizer({self.words!r})"
