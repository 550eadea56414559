"""A sequence in the engine: its token ids and a block table into the KV cache, nothing else on the
device. What a request thread hears back from the engine travels on the sequence's event queue."""

from __future__ import annotations

import enum
import itertools
import queue
import time
from collections import abc
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.engine.hashing import prefix_hashes
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.sampling import Sampler
from protos.block_hash import BlockHash

_seq_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission (again, after a preemption)
    LOADING = "loading"  # blocks reserved; its KVSource is filling them
    RUNNING = "running"  # computing its prompt in chunks, or decoding
    FINISHED = "finished"


class KVSource(Protocol):
    """Where a sequence's KV comes from beyond this engine's KV cache, and where it goes when the sequence
    leaves (the KV store). Both run on the engine's I/O threads, never on its step thread."""

    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        """Write the KV of ``seq``'s blocks ``first_block, first_block + 1, ...`` into ``cache`` blocks ``blocks``
        (the last may be partial) and return how many tokens from ``first_block * block_size`` on are
        now there, leading and contiguous; 0 on any failure. Never more than ``len(token_ids) - 1``."""
        ...

    def save(self, seq: Sequence, first_block: int, kv: abc.Sequence[torch.Tensor], num_tokens: int) -> None:
        """Keep ``kv``, the sequence's blocks from ``first_block`` on (each [layers, 2, block_size, kv_heads,
        head_dim], the KV cache's slots themselves, valid only during the call), holding ``num_tokens`` tokens
        (the last block may be partial). Best effort."""
        ...


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A sampled token; ``finish_reason`` ("length" or "stop") when the engine stops the sequence on it."""

    token_id: int
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The sequence has left the engine, its blocks freed and its KV saved; always the last event.

    ``reason`` is "length", "stop", "aborted", "error" (``error`` says what) or "shutdown"."""

    reason: str
    error: str = ""


Event = TokenEvent | Finished


@dataclass(slots=True)
class SequenceStats:
    """Counters of one sequence, for metrics and tests: no scheduling decision reads them."""

    arrival: float = field(default_factory=time.perf_counter)
    num_pool_hit_tokens: int = 0  # prompt tokens taken from the pool since the latest admission
    num_coalesced_tokens: int = 0  # of those, the ones taken after admission, computed by another sequence
    num_loaded_tokens: int = 0  # from the source, at the latest admission
    num_engine_computed_tokens: int = 0  # prompt tokens this engine computed (not generated ones)
    num_preemptions: int = 0


@dataclass(eq=False, slots=True)
class Sequence:
    """Token ids, of which the first ``num_computed_tokens`` have KV in the KV cache blocks of ``block_table``.

    ``hash_root`` seeds the prefix hashes under which full blocks are shared with other sequences
    through the pool, and saved to the source as they fill; None keeps them private (saved only when the
    sequence leaves). ``num_saved_blocks`` leading full blocks are in the KV source already, or on their
    way there, and are not saved again.
    """

    token_ids: list[int]
    sampler: Sampler
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    hash_root: BlockHash | None = None
    source: KVSource | None = None
    num_saved_blocks: int = 0
    request_id: str = ""
    keep_logits: bool = False  # keep the logits of the latest sampled token in ``logits``
    logits: torch.Tensor | None = field(default=None, repr=False)  # [vocab] fp32
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks registered in the pool under their hash
    num_computed_tokens: int = 0
    # more prompt left, when first scheduled, than one step holds: chunked to the scheduler's long_prompt_chunk
    # while streams decode, to its last chunk; None until then
    long_prompt: bool | None = None
    status: Status = Status.WAITING
    aborting: str | None = None  # "save" or "drop", set while LOADING
    saving: bool = False  # a preemption's save is in flight; not admitted until it lands
    last_save: Future[None] | None = field(default=None, repr=False)  # its latest save; the next one waits for it
    events: queue.SimpleQueue[Event] = field(default_factory=queue.SimpleQueue, repr=False)
    stats: SequenceStats = field(default_factory=SequenceStats)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)  # its own: the engine appends to it
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def full_block_hashes(self, block_size: int, num_blocks: int) -> list[BlockHash]:
        """Prefix hashes of the first ``num_blocks`` full blocks, computed once each."""
        assert self.hash_root is not None
        if (have := len(self.block_hashes)) < num_blocks:
            parent = self.block_hashes[-1] if have else self.hash_root
            self.block_hashes += prefix_hashes(self.token_ids[have * block_size : num_blocks * block_size], block_size,
                                               parent)
        return self.block_hashes[:num_blocks]
