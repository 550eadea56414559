"""Which sequences go into the next forward, and with how many tokens (continuous batching).

Each step takes every decoding sequence's next token first, then chunks of prompts being computed,
under a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``), so a long
prompt is spread over many steps and never stalls the streams already running. A sequence is
admitted only when the pool can hold all its current tokens; when decoding sequences need a block
and none is left, the newest running sequence is preempted: its blocks are freed (those past what
its KV source already holds are first copied out to be saved there) and it waits to be admitted
again, from the pool's cached blocks, its source, and recomputation, in that order.

Sequences that share a prefix nobody has computed yet compute it once (in-flight prefix coalescing). A
sequence about to compute prompt tokens first claims its next full blocks in ``in_flight``, by prefix
hash; another sequence whose next blocks are claimed computes no token of them: it stays admitted and
spends none of the budget until the owner has computed and registered them, then takes them from the
pool by hash, like any prefix hit. A claim ends when its block is registered or its owner leaves
(finished, aborted, failed or preempted); a waiter then computes what is left itself. An owner was
running before its waiters (it claimed first), so it gets the budget first: a waiter waits only while
its owner is running and computing, or while the budget would have run out before reaching it anyway.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.sequence import Sequence, Status
from protos.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    # While sequences decode, a prompt with more tokens left, when its first chunk is scheduled, than one step
    # holds (a document, a cold system prompt) gets at most this many a step, its last chunk too, so the
    # streams' steps stay short; one that fits a step (a chat turn) is computed in that step. 0: no cap
    # (vLLM's long_prefill_token_threshold is the same idea).
    long_prompt_chunk: int = 0

    def __post_init__(self) -> None:
        if self.long_prompt_chunk < 0:
            raise ValueError(f"long_prompt_chunk must be at least 0, got {self.long_prompt_chunk}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every running sequence's next token must fit one forward"
            )


@dataclass(frozen=True, slots=True)
class Spill:
    """Blocks of a sequence leaving the pool that its source should keep: ``blocks`` from ``first_block``
    on, holding ``num_tokens`` tokens. Their contents stay valid until the next forward."""

    seq: Sequence
    first_block: int
    blocks: list[int]
    num_tokens: int


@dataclass(slots=True)
class Schedule:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    admitted: list[Sequence] = field(default_factory=list)
    to_load: list[Sequence] = field(default_factory=list)  # admitted, for their source to fill
    spills: list[Spill] = field(default_factory=list)  # from preemptions
    num_preempted: int = 0
    num_prompt_tokens: int = 0  # of the scheduled tokens, those of prompts
    num_pool_hit_tokens: int = 0  # prompt tokens taken from the pool: at admission, or by coalescing
    num_coalesced_tokens: int = 0  # prompt tokens taken from the pool once another sequence computed them

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, config: SchedulerConfig) -> None:
        self.pool = pool
        self.block_size = block_size
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.loading: list[Sequence] = []  # admitted; their source is filling their blocks
        self.in_flight: dict[BlockHash, Sequence] = {}  # full blocks claimed by the running sequence computing them

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def blocks_needed(self, num_tokens: int) -> int:
        return _blocks_for(num_tokens, self.block_size)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self) -> Schedule:
        out = Schedule()
        budget = self.config.max_num_batched_tokens
        decoding = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1]
        for seq in decoding:
            if budget == 0:
                break
            if seq.status is Status.RUNNING and self._grow(seq, out):
                out.scheduled.append((seq, 1))
                budget -= 1
        streams = bool(out.scheduled)
        for seq in [s for s in self.running if len(s.token_ids) - s.num_computed_tokens > 1]:
            self._coalesce(seq, out)  # spends no budget, and frees the blocks it had reserved for them
            if budget:
                budget -= self._schedule_prompt(seq, self._chunk(seq, budget, streams), out)
        while budget and self.waiting and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.saving or not self._admit(seq):
                break
            self.waiting.popleft()
            out.admitted.append(seq)
            out.num_pool_hit_tokens += seq.stats.num_pool_hit_tokens
            if seq.status is Status.LOADING:
                out.to_load.append(seq)
            else:
                budget -= self._schedule_prompt(seq, self._chunk(seq, budget, streams), out)
        out.num_prompt_tokens = sum(min(n, max(0, s.num_prompt_tokens - s.num_computed_tokens))
                                    for s, n in out.scheduled)
        return out

    def _chunk(self, seq: Sequence, budget: int, streams: bool) -> int:
        """The most of ``seq``'s prompt this step may take (SchedulerConfig.long_prompt_chunk)."""
        cap = self.config.long_prompt_chunk
        return min(budget, cap) if cap and streams and self._long(seq) else budget

    def _long(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt had more tokens left than one step holds when its first chunk was scheduled
        (until then: has now), so that its last chunk, which would fit a step, is capped too."""
        if seq.long_prompt is not None:
            return seq.long_prompt
        return len(seq.token_ids) - seq.num_computed_tokens > self.config.max_num_batched_tokens

    def _schedule_prompt(self, seq: Sequence, budget: int, out: Schedule) -> int:
        """Schedule up to ``budget`` of ``seq``'s next tokens, stopping before blocks another sequence is
        computing; how many (0: it waits for them, and may take them from the pool after)."""
        end = min(len(seq.token_ids), seq.num_computed_tokens + budget)
        if seq.hash_root is not None:
            end = min(end, self._claim(seq))
        n = end - seq.num_computed_tokens
        if n:
            seq.long_prompt = self._long(seq)
            out.scheduled.append((seq, n))
        return n

    def _coalesce(self, seq: Sequence, out: Schedule) -> None:
        """Swap ``seq``'s next blocks for the pool's, where they were computed since its admission."""
        bs, first = self.block_size, seq.num_computed_tokens // self.block_size
        if seq.hash_root is None or seq.num_computed_tokens % bs:
            return
        hits = self.pool.take_hits(seq.full_block_hashes(bs, (len(seq.token_ids) - 1) // bs)[first:])
        if not hits:
            return
        end = first + len(hits)
        self.pool.free(seq.block_table[first:end])  # reserved at admission, never written
        seq.block_table[first:end] = hits
        seq.num_computed_tokens = end * bs
        seq.num_registered_blocks = end
        seq.stats.num_pool_hit_tokens += len(hits) * bs
        seq.stats.num_coalesced_tokens += len(hits) * bs
        out.num_pool_hit_tokens += len(hits) * bs
        out.num_coalesced_tokens += len(hits) * bs

    def _claim(self, seq: Sequence) -> int:
        """Claim ``seq``'s uncomputed full blocks that nobody has claimed; where it must stop: at the first block
        another sequence claimed, unless that block holds ``seq``'s last token (always computed here)."""
        bs = self.block_size
        hashes = seq.full_block_hashes(bs, len(seq.token_ids) // bs)
        shareable = (len(seq.token_ids) - 1) // bs
        for i in range(-(-seq.num_computed_tokens // bs), len(hashes)):
            if self.in_flight.setdefault(hashes[i], seq) is not seq and i < shareable:
                return i * bs
        return len(seq.token_ids)

    def _release(self, seq: Sequence) -> None:
        """Drop ``seq``'s claims: sequences waiting for those blocks compute them themselves."""
        for h in seq.block_hashes:
            if self.in_flight.get(h) is seq:
                del self.in_flight[h]

    def register(self, seq: Sequence) -> None:
        """Name ``seq``'s newly full blocks in the pool, for other sequences to reuse, and end their claims."""
        if seq.hash_root is None:
            return
        full = seq.num_computed_tokens // self.block_size
        hashes = seq.full_block_hashes(self.block_size, full)
        for i in range(seq.num_registered_blocks, full):
            self.pool.register(seq.block_table[i], hashes[i])
            self.in_flight.pop(hashes[i], None)
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _grow(self, seq: Sequence, out: Schedule) -> bool:
        """Room for ``seq``'s next token, preempting the newest unscheduled sequences; False if ``seq``
        itself was preempted."""
        need = self.blocks_needed(seq.num_computed_tokens + 1) - len(seq.block_table)
        while need > self.pool.num_available:  # rare: the scheduled set is built only here
            scheduled = {id(s) for s, _ in out.scheduled}
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), seq)
            self.preempt(victim, out)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Reserve blocks for all of ``seq``'s tokens, reusing the pool's blocks of its leading prefix."""
        bs = self.block_size
        hashes = seq.full_block_hashes(bs, (len(seq.token_ids) - 1) // bs) if seq.hash_root is not None else []
        hits = self.pool.count_hits(hashes)
        need = self.blocks_needed(len(seq.token_ids)) - hits
        # Keep one block of headroom per admitted sequence (each may need one soon), and count every hit
        # as if it were taken from the cached blocks. Alone, a sequence always fits (Engine.add checks).
        if need + hits > self.pool.num_available - len(self.running) - len(self.loading):
            return False
        self._take(seq, hashes, hits, need)
        return True

    def _take(self, seq: Sequence, hashes: list[BlockHash], hits: int, need: int) -> None:
        seq.block_table = self.pool.take_hits(hashes[:hits]) + self.pool.allocate(need)
        seq.num_computed_tokens = seq.stats.num_pool_hit_tokens = hits * self.block_size
        seq.stats.num_coalesced_tokens = 0
        seq.num_registered_blocks = hits
        seq.stats.num_loaded_tokens = 0
        if seq.source is not None and seq.num_computed_tokens < len(seq.token_ids) - 1:
            seq.status = Status.LOADING
            self.loading.append(seq)
        else:
            seq.status = Status.RUNNING
            self.running.append(seq)

    def loaded(self, seq: Sequence, num_tokens: int) -> None:
        """The source filled ``num_tokens`` tokens after the pool's hits."""
        self.loading.remove(seq)
        seq.stats.num_loaded_tokens = num_tokens
        seq.num_computed_tokens += num_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)

    def preempt(self, seq: Sequence, out: Schedule) -> None:
        self.running.remove(seq)
        self._release(seq)
        spill = self.spill(seq, seq.num_computed_tokens // self.block_size * self.block_size)
        if spill is not None:
            out.spills.append(spill)
            seq.saving = True
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_registered_blocks = 0
        seq.long_prompt = None  # what it has left when admitted again decides
        seq.stats.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.num_preempted += 1

    def spill(self, seq: Sequence, num_tokens: int) -> Spill | None:
        """The blocks holding tokens up to ``num_tokens`` past those the source already has, if any."""
        if seq.source is None:
            return None
        first = seq.num_saved_blocks
        end = self.blocks_needed(num_tokens)
        if end <= first:
            return None
        return Spill(seq, first, seq.block_table[first:end], num_tokens - first * self.block_size)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out (running or waiting) and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.LOADING:
            self.loading.remove(seq)
        self._release(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED
