"""`ByteTokenizer`: the smallest real tokenizer, one token per UTF-8 byte.

Enough for the book's examples: token ids are the bytes of the text (0..255), so a prefix of
the text is a prefix of the ids and a reader can see what a radix-tree node holds. A node's key
may end in the middle of a multi-byte character; `decode` then shows the stray bytes escaped
(``\\xe4``) instead of failing.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch

from .._validate import as_int, check_token_ids

__all__ = ["ByteTokenizer"]

_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


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
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)

    def decode(self, ids: Union[torch.Tensor, Iterable[int]]) -> str:
        """Text of ``ids`` (bytes 0..255); non-printable characters and broken UTF-8 escaped.

        ``ids``: a 1-D integer CPU tensor or an iterable of integers (Python, NumPy or 0-d torch
        integers); ``TypeError`` for anything else (``65.9`` is not ``65``), ``ValueError`` out of range.
        """
        if isinstance(ids, torch.Tensor):
            values = check_token_ids(ids, "ids").tolist()
        elif isinstance(ids, (str, bytes, bytearray)):
            raise TypeError(f"ids must be token ids (a tensor or integers), got {type(ids).__name__}")
        else:
            values = [as_int(v, f"ids[{i}]") for i, v in enumerate(ids)]
        bad = [v for v in values if not 0 <= v <= 255]
        if bad:
            raise ValueError(f"byte token ids must be in [0, 255], got {bad[:4]}")
        text = bytes(values).decode("utf-8", errors="backslashreplace")
        return "".join(ch if ch.isprintable() else _ESCAPES.get(ch, ch.encode("unicode_escape").decode("ascii"))
                       for ch in text)

    def __call__(self, text: str) -> torch.Tensor:
        return self.encode(text)

    def __repr__(self) -> str:
        return "ByteTokenizer()"
