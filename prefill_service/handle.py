"""What prefill hands to decode: where the prompt's KV lies in the store, and the first token."""

from __future__ import annotations

from dataclasses import dataclass

from protos.kvserve.v1 import prefill_pb2


@dataclass(frozen=True, slots=True)
class PrefillTimings:
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    compute_s: float = 0.0
    put_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillHandle:
    """`block_hashes[i]` keys full block i of the prompt; `tail_key` the partial last block (b"" if none).

    With the prefix cache off, the keys are request-scoped (and ephemeral) rather than prefix hashes.
    `lease_id` pins the blocks until decode has fetched them; decode releases it.
    `model_fingerprint` names the model that tokenized the prompt and sampled the first token.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_size: int
    block_hashes: tuple[bytes, ...]
    tail_key: bytes
    num_cached_tokens: int
    num_computed_tokens: int
    first_token_id: int
    timings: PrefillTimings
    lease_id: str = ""
    model_fingerprint: str = ""


def handle_to_proto(h: PrefillHandle) -> prefill_pb2.PrefillResponse:
    t = h.timings
    return prefill_pb2.PrefillResponse(
        request_id=h.request_id,
        prompt_token_ids=list(h.prompt_token_ids),
        block_size=h.block_size,
        block_hashes=list(h.block_hashes),
        tail_key=h.tail_key,
        num_cached_tokens=h.num_cached_tokens,
        num_computed_tokens=h.num_computed_tokens,
        first_token_id=h.first_token_id,
        timings=prefill_pb2.PrefillTimings(
            lookup_s=t.lookup_s, fetch_s=t.fetch_s, compute_s=t.compute_s, put_s=t.put_s, total_s=t.total_s
        ),
        lease_id=h.lease_id,
        model_fingerprint=h.model_fingerprint,
    )


def handle_from_proto(r: prefill_pb2.PrefillResponse) -> PrefillHandle:
    t = r.timings
    return PrefillHandle(
        request_id=r.request_id,
        prompt_token_ids=tuple(r.prompt_token_ids),
        block_size=r.block_size,
        block_hashes=tuple(r.block_hashes),
        tail_key=r.tail_key,
        num_cached_tokens=r.num_cached_tokens,
        num_computed_tokens=r.num_computed_tokens,
        first_token_id=r.first_token_id,
        timings=PrefillTimings(t.lookup_s, t.fetch_s, t.compute_s, t.put_s, t.total_s),
        lease_id=r.lease_id,
        model_fingerprint=r.model_fingerprint,
    )
