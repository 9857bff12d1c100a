"""Incremental detokenization, one way for the server and the CLIs: tokenizers' `DecodeStream`.

Tokens go in as they are generated; out comes the text they complete. Bytes of a character that a token
leaves unfinished wait for the next token, so no piece of text ever holds half a character.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer; save it as tokenizer.json")
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, tokens: list[int]) -> str:
        """The text that `tokens` complete ("" while a character is unfinished)."""
        return "".join(piece for token in tokens if (piece := self.stream.step(self.backend, token)) is not None)
