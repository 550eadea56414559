"""The request contract that decode and prefill share: the prompt, the request options and the
prefill handle, with their kvserve.v1 protobuf codec, validated where a request enters a service.

Decode receives a `Prompt`, `SamplingParams` and `CacheOptions` and forwards them to prefill, which
answers with the handle. Checks that need no model live here; checks against the model
(vocabulary, context length) run where the model is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.engine.model import ContextLengthError, Model, encode_prompt
from kvserve.engine.sampling import SamplingParams
from kvserve.rpc.errors import InvalidArgument
from protos.block_hash import HASH_BYTES, BlockHash
from protos.kvserve.v1 import common_pb2, prefill_pb2

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16
MAX_LEASE_ID_CHARS = 64  # a store's lease ids are 32 hex digits


@dataclass(frozen=True, slots=True)
class PromptInput:
    """Exactly one of text, chat messages ((role, content) pairs) or token ids."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What a client may ask of one generation; `max_tokens` 0 means the service default."""

    sampling: SamplingParams
    max_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    prefix_cache: bool = True
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class PrefillTimings:
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    compute_s: float = 0.0
    put_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillHandle:
    """`block_hashes[i]` keys full block i of the prompt; `tail_key` the partial last block (None if none).

    With the prefix cache off, the keys are request-scoped (and ephemeral) rather than prefix hashes.
    `lease_id` pins the blocks until decode has fetched them (those past the caller's `num_stored_blocks`, when
    it sent them: its own lease pins the others; empty when there are none); decode releases it.
    `model_fingerprint` names the model that tokenized the prompt and sampled the first token.
    `kv_pending`: an early handle, sent with the first token before the KV is stored (no keys yet).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_size: int
    block_hashes: tuple[BlockHash, ...]
    tail_key: BlockHash | None
    num_cached_tokens: int
    num_computed_tokens: int
    first_token_id: int
    timings: PrefillTimings
    lease_id: str = ""
    model_fingerprint: str = ""
    kv_pending: bool = False


def encode(model: Model, prompt: PromptInput) -> list[int]:
    """Token ids of the prompt; a bad prompt (token id outside the vocabulary...) is InvalidArgument, a text too
    long from its bytes alone ContextLengthError (OUT_OF_RANGE, as past the positions once tokenized)."""
    messages = None
    if prompt.messages is not None:
        messages = [{"role": role, "content": content} for role, content in prompt.messages]
    try:
        return encode_prompt(
            model,
            text=prompt.text,
            messages=messages,
            token_ids=list(prompt.token_ids) if prompt.token_ids is not None else None,
        )
    except ContextLengthError:
        raise
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def check_text_fits(model: Model, prompt: PromptInput, max_tokens: int) -> None:
    """ContextLengthError when a text prompt and `max_tokens` (0: the default, at least one) cannot fit the
    model's positions whatever the text tokenizes to, told without tokenizing: no token covers more than
    `Model.max_token_bytes` of it, the bound encode_prompt refuses a long text by. Of chat messages only the
    users' contents count, trimmed: a template may trim them, and leave the other roles out. Token ids are
    not looked at (the caller counts them)."""
    limit = model.max_positions
    if limit is None or prompt.token_ids is not None:
        return
    if prompt.text is not None:
        what, texts = "the prompt is", [prompt.text]
    else:
        what, texts = "the user messages are", [c.strip() for r, c in prompt.messages or () if r == "user"]
    room = limit - max(max_tokens, 1)  # the most prompt tokens that fit
    per_token = model.max_token_bytes
    if sum(map(len, texts)) * 4 <= room * per_token:  # fits at 4 UTF-8 bytes a character: no need to count them
        return
    num_bytes = sum(len(t.encode()) for t in texts)
    at_least = -(-num_bytes // per_token)
    if at_least <= room:
        return
    why = f"{what} {num_bytes} bytes, at least {at_least} tokens (no token covers more than {per_token} bytes)"
    if not max_tokens:
        raise ContextLengthError(f"{why}; the model takes at most {limit} positions: send a shorter prompt")
    raise ContextLengthError(f"{why} + max_tokens ({max_tokens}) = at least {at_least + max_tokens}, past the "
                             f"model's {limit} positions: send a shorter prompt, or ask for fewer tokens")


def prompt_from_proto(prompt: common_pb2.Prompt) -> PromptInput:
    kind = prompt.WhichOneof("kind")
    if kind == "text":
        if not prompt.text:
            raise InvalidArgument("the prompt text is empty")
        return PromptInput(text=prompt.text)
    if kind == "messages":
        messages = tuple((m.role, m.content) for m in prompt.messages.messages)
        if not messages:
            raise InvalidArgument("the prompt has no chat messages")
        unknown = sorted({role for role, _ in messages} - CHAT_ROLES)
        if unknown:
            raise InvalidArgument(f"unknown chat role(s) {unknown}: use one of {sorted(CHAT_ROLES)}")
        return PromptInput(messages=messages)
    if kind == "token_ids":
        if not prompt.token_ids.ids:
            raise InvalidArgument("the prompt has no token ids")
        return PromptInput(token_ids=tuple(prompt.token_ids.ids))
    raise InvalidArgument("the request has no prompt: set one of text, messages or token_ids")


def prompt_to_proto(prompt: PromptInput) -> common_pb2.Prompt:
    if prompt.text is not None:
        return common_pb2.Prompt(text=prompt.text)
    if prompt.messages is not None:
        msgs = [common_pb2.ChatMessage(role=r, content=c) for r, c in prompt.messages]
        return common_pb2.Prompt(messages=common_pb2.ChatMessages(messages=msgs))
    return common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=list(prompt.token_ids or ())))


def options_from_proto(sampling: common_pb2.SamplingParams, cache: common_pb2.CacheOptions) -> RequestOptions:
    temperature, top_p = float(sampling.temperature), float(sampling.top_p)
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        raise InvalidArgument(f"top_p must be in [0, 1] (0 or 1 is off), got {top_p}")
    stop = tuple(sampling.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not s for s in stop):
        raise InvalidArgument("stop strings must not be empty")
    params = SamplingParams(
        temperature=temperature,
        top_k=int(sampling.top_k),
        top_p=top_p if top_p > 0 else 1.0,
        seed=int(sampling.seed) if sampling.HasField("seed") else None,
    )
    return RequestOptions(
        sampling=params,
        max_tokens=int(sampling.max_tokens),
        stop=stop,
        ignore_eos=bool(sampling.ignore_eos),
        prefix_cache=cache.prefix_cache if cache.HasField("prefix_cache") else True,
        cache_salt=cache.cache_salt,
    )


def options_to_proto(options: RequestOptions) -> tuple[common_pb2.SamplingParams, common_pb2.CacheOptions]:
    p = options.sampling
    sampling = common_pb2.SamplingParams(
        max_tokens=options.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        stop=list(options.stop), ignore_eos=options.ignore_eos,
    )
    if p.seed is not None:
        sampling.seed = p.seed
    cache = common_pb2.CacheOptions(prefix_cache=options.prefix_cache, cache_salt=options.cache_salt)
    return sampling, cache


def stored_blocks_from_proto(request: prefill_pb2.PrefillRequest) -> int | None:
    """What the caller's own lookup found (PrefillRequest.num_stored_blocks): how many of the prompt's leading
    full blocks the store holds; None when it sent nothing (prefill then looks them up). Another process's
    word, so only a count of blocks to read (each verified as it is read), cut by `bounded_stored_blocks`."""
    return int(request.num_stored_blocks) if request.HasField("num_stored_blocks") else None


def bounded_stored_blocks(num_stored_blocks: int, num_reusable: int) -> int:
    """The caller's count within the prompt: never past its `num_reusable` blocks (those before the block of
    its last token). A decode of another block size counts other blocks: a count past them is cut, not refused,
    so that decode can name the mismatch (FAILED_PRECONDITION) when the handle comes back."""
    return max(0, min(num_stored_blocks, num_reusable))


def handle_to_proto(h: PrefillHandle) -> prefill_pb2.PrefillResponse:
    t = h.timings
    return prefill_pb2.PrefillResponse(
        request_id=h.request_id,
        prompt_token_ids=list(h.prompt_token_ids),
        block_size=h.block_size,
        block_hashes=list(h.block_hashes),
        tail_key=h.tail_key or b"",
        num_cached_tokens=h.num_cached_tokens,
        num_computed_tokens=h.num_computed_tokens,
        first_token_id=h.first_token_id,
        timings=prefill_pb2.PrefillTimings(
            lookup_s=t.lookup_s, fetch_s=t.fetch_s, compute_s=t.compute_s, put_s=t.put_s, total_s=t.total_s
        ),
        lease_id=h.lease_id,
        model_fingerprint=h.model_fingerprint,
        kv_pending=h.kv_pending,
    )


class MalformedHandle(ValueError):
    """A prefill answer that no prefill service sends: its shape does not add up."""


def handle_from_proto(r: prefill_pb2.PrefillResponse) -> PrefillHandle:
    """The handle of a prefill answer, checked for shape (what another process sends is bounded and
    verified before it is used; the token ids against the model in decode). MalformedHandle says what
    does not add up."""
    problem = (
        "no prompt token ids" if not r.prompt_token_ids
        else f"block size {r.block_size}" if r.block_size < 1
        else f"{len(r.block_hashes)} block hashes for {len(r.prompt_token_ids)} tokens"
        if len(r.block_hashes) > len(r.prompt_token_ids) // r.block_size
        else "a block hash that is not 32 bytes" if any(len(h) != HASH_BYTES for h in r.block_hashes)
        else "a tail key that is not 32 bytes" if r.tail_key and len(r.tail_key) != HASH_BYTES
        else f"a lease id of {len(r.lease_id)} characters" if len(r.lease_id) > MAX_LEASE_ID_CHARS
        else f"{r.num_cached_tokens} cached tokens of {len(r.prompt_token_ids)}"
        if r.num_cached_tokens > len(r.prompt_token_ids) else ""
    )
    if problem:
        raise MalformedHandle(f"the prefill answer has {problem}")
    t = r.timings
    return PrefillHandle(
        request_id=r.request_id,
        prompt_token_ids=tuple(r.prompt_token_ids),
        block_size=r.block_size,
        block_hashes=tuple(BlockHash(h) for h in r.block_hashes),
        tail_key=BlockHash(r.tail_key) if r.tail_key else None,
        num_cached_tokens=r.num_cached_tokens,
        num_computed_tokens=r.num_computed_tokens,
        first_token_id=r.first_token_id,
        timings=PrefillTimings(t.lookup_s, t.fetch_s, t.compute_s, t.put_s, t.total_s),
        lease_id=r.lease_id,
        model_fingerprint=r.model_fingerprint,
        kv_pending=r.kv_pending,
    )
