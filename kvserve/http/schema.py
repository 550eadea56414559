"""The OpenAI request bodies kvserve serves, checked field by field, and their GenerateRequest.

Every field of OpenAI's API that kvserve does not implement is refused with a 400 that names it: a client
that asks for log probabilities, tools or penalties learns it did not get them. A few of those are accepted
at the value that asks for nothing (`"n": 1`, `"logprobs": false`, penalties of 0), which SDKs and
frameworks send by default. Omitted sampling fields take OpenAI's defaults (temperature 1, top_p 1), so a
client gets the behaviour it would get from OpenAI; `"temperature": 0` is greedy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from client.client import build_request
from protos.kvserve.v1 import decode_pb2

MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256

# Fields kvserve leaves at their neutral value only: each maps to the value that asks for nothing.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False,), "echo": (False,),
    "best_of": (1,), "suffix": ("",),
}


def short(text: str, limit: int = 64) -> str:
    """`text` cut to `limit` characters: an error names what it refuses, it does not echo a megabyte back."""
    return text if len(text) <= limit else f"{text[:limit]}…"


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed)  # 0 is not False here


class BadRequest(ValueError):
    """A body kvserve cannot serve as asked; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    """What chat and completions share."""

    model: Annotated[str, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, lt=2**32)] | None = None  # kvserve's own: 0 is off
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: int | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # kvserve's own: generate max_tokens tokens whatever the model says
    # Accepted only at their neutral value (NEUTRAL).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        for s in [value] if isinstance(value, str) else value or []:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _neutral(self) -> _Request:
        for name, allowed in NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and not _neutral(value, allowed):
                raise BadRequest(f"{name}={short(repr(value))} is not supported by kvserve (only {allowed[0]!r}); "
                                 "leave it out", name, "unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with \"stream\": true", "stream_options")
        return self

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _generate(self, request_id: str, max_tokens: int | None, **prompt: Any) -> decode_pb2.GenerateRequest:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return build_request(
                **prompt, max_tokens=max_tokens or 0,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, request_id=request_id)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    logprobs: bool | None = None

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise BadRequest("max_tokens and max_completion_tokens disagree: give one", "max_completion_tokens")
        return self

    def generate_request(self, request_id: str) -> decode_pb2.GenerateRequest:
        # "developer" is OpenAI's newer name for the system message; chat templates know "system".
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        return self._generate(request_id, self.max_completion_tokens or self.max_tokens, messages=messages)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**32)]], Field(min_length=1)]


class CompletionRequest(_Request):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: int | None = None  # OpenAI's 0 still returns the sampled token's: only null is neutral
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def generate_request(self, request_id: str) -> decode_pb2.GenerateRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):  # a batch of prompts
            if len(prompt) != 1:
                raise BadRequest(f"prompt holds {len(prompt)} prompts; kvserve takes one per request", "prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            return self._generate(request_id, self.max_tokens or 16, prompt=prompt)  # OpenAI's default: 16
        return self._generate(request_id, self.max_tokens or 16, token_ids=prompt)


def parse(model: type[_Request], body: Any) -> Any:
    """`body` (decoded JSON) as `model`, or BadRequest naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except BadRequest:
        raise
    except ValidationError as exc:
        first = exc.errors()[0]
        if isinstance(first.get("ctx", {}).get("error"), BadRequest):
            raise first["ctx"]["error"] from None
        param = short(".".join(str(part) for part in first["loc"])) or None
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"unsupported field {param!r}: kvserve does not implement it; leave it out", param,
                             "unsupported_field") from None
        if first["type"] == "missing":
            raise BadRequest(f"missing required field {param!r}", param, "missing_field") from None
        raise BadRequest(f"{param or 'the body'}: {first['msg']}", param) from None
