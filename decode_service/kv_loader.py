"""Decode's side of the hand-off: the prompt's KV from the store, or recomputed where it is not.

A block that is missing or fails verification is a miss (DESIGN.md, "Failure policy"): decode
keeps the leading good blocks and recomputes the rest of the prompt itself.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from engine.engine import Engine, Sequence
from engine.hashing import Namespace
from engine.kv_codec import BlockError
from serving.cache_session import StoreSession
from serving.requests import PrefillHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedPrompt:
    seq: Sequence
    num_stored_blocks: int  # leading full prompt blocks found good in the store
    num_recomputed_tokens: int
    bad_block: BlockError | None = None


def load_prompt_kv(
    engine: Engine, engine_lock: threading.Lock, store: StoreSession, handle: PrefillHandle, namespace: Namespace
) -> LoadedPrompt:
    prompt = handle.prompt_token_ids
    bs = engine.block_size
    num_full, tail_len = divmod(len(prompt), bs)
    keys, tail_key = list(handle.block_hashes), handle.tail_key
    if len(keys) != num_full:  # a malformed handle: trust none of its keys
        log.warning("prefill handle names %d blocks for %d full blocks: recomputing the prompt",
                    len(keys), num_full)
        keys, tail_key = [], None
    payloads = store.get(keys + [tail_key] if tail_key is not None else keys)
    leading = engine.load_leading(payloads[:num_full] if keys else [], namespace)
    blocks, bad = leading.blocks, leading.error
    tail = None
    if len(blocks) == num_full and tail_len and tail_key is not None and payloads[-1] is not None:
        try:
            tail = engine.load_tail(payloads[-1], namespace, tail_len)
        except BlockError as exc:
            bad = exc
    complete = len(blocks) == num_full and (tail_len == 0 or tail is not None)
    with engine_lock:
        if complete:
            return LoadedPrompt(engine.resume(prompt, blocks, tail), len(blocks), 0, bad)
        result = engine.prefill(prompt, blocks)
    return LoadedPrompt(result.sequence, len(blocks), result.num_computed_tokens, bad)
