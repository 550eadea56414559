"""Incremental detokenization: the text each new token completes, never half a character.

Byte-level tokenizers split a UTF-8 character over several tokens; decoding a prefix of them gives
U+FFFD. Text is released only once it decodes cleanly (the prefix/read offset scheme of TGI and
vLLM), with a few earlier tokens as context so that tokenizers which merge across tokens agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token_id: int) -> str:
        """Appends a token; returns the new text that is now complete (may be "")."""
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end of generation)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) > len(prefix) and (final or not text.endswith(REPLACEMENT)):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return text[len(prefix) :]
        return ""
