"""When a generation ends, and which text it has produced: max_tokens, EOS, stop strings.

`Generation.accept(token)` is called once per sampled token (the first from prefill, the rest
from the decode loop) and says what to stream for it and whether the request is finished;
`Generation.replay(tokens)` takes the tokens of a stream that another replica started. Text
that might be the start of a stop string is held back until it is known not to be one, so a
streaming client never sees text that the final result does not contain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from decode_service.detokenizer import IncrementalDetokenizer

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_EOS = "eos"


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One generated token, the text it releases, and the finish reason if it is the last one."""

    token_id: int
    text: str
    finish_reason: str | None = None


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


@dataclass(slots=True)
class Generation:
    tokenizer: Any
    prompt_token_ids: Sequence[int]
    max_tokens: int
    eos_token_ids: frozenset[int]
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text released so far (what the client has been sent)
    finish_reason: str | None = None
    _pending: str = ""  # decoded but held back: may begin a stop string
    _detok: IncrementalDetokenizer | None = None

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token_id: int) -> TokenOutput:
        assert self._detok is not None and not self.finished
        self.token_ids.append(token_id)
        if token_id in self.eos_token_ids and not self.ignore_eos:
            return self._finish(token_id, FINISH_EOS, self._detok.flush())
        new_text = self._detok.add(token_id)
        if len(self.token_ids) >= self.max_tokens:
            return self._finish(token_id, FINISH_LENGTH, new_text + self._detok.flush())
        if not self.stop:
            self.text += new_text
            return TokenOutput(token_id, new_text)
        return self._check_stop(token_id, new_text)

    def replay(self, token_ids: Sequence[int]) -> None:
        """Accept tokens that were already streamed (by a replica that then died) and stream nothing: the
        text held back for a stop string and the detokenizer are then as they were after them, so the next
        token releases what it released there. ValueError if one comes after the generation's end."""
        for i, token_id in enumerate(token_ids):
            if self.finished:
                raise ValueError(f"token {i} of {len(token_ids)} comes after the end of the generation "
                                 f"(token {i - 1} ends it: {self.finish_reason})")
            self.accept(token_id)

    def _check_stop(self, token_id: int, new_text: str) -> TokenOutput:
        search_from = max(0, len(self._pending) - max(len(s) for s in self.stop) + 1)
        self._pending += new_text
        hits = [i for i in (self._pending.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            released = self._pending[: min(hits)]
            self._pending = ""
            self.text += released
            self.finish_reason = FINISH_STOP
            return TokenOutput(token_id, released, FINISH_STOP)
        keep = _held_suffix(self._pending, self.stop)
        released = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(released) :]
        self.text += released
        return TokenOutput(token_id, released)

    def _finish(self, token_id: int, reason: str, new_text: str) -> TokenOutput:
        if self.stop:
            out = self._check_stop(token_id, new_text)
            if out.finish_reason is not None:
                return out
            new_text, self._pending = self._pending, ""
            self.text += new_text
            new_text = out.text + new_text
        else:
            self.text += new_text
        self.finish_reason = reason
        return TokenOutput(token_id, new_text, reason)
