"""Shared helpers for the engine tests: tiny models built once per test process, engines with a KV cache of a
given size, running sequences to completion, oracle checks, and a KV store in a dict with a KV source
over it."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from kvserve.engine.engine import Engine, StepStats
from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.model import Model, load_model
from kvserve.engine.sampling import Sampler, SamplingParams
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.engine.sequence import Finished
from kvserve.engine.sequence import Sequence as KVSequence
from kvserve.engine.tiny import init_tiny_model
from kvserve.handoff.transfer import EncodedBlock, encoded_bytes, load_blocks, save_blocks
from protos.block_hash import BlockHash

ARCHS = ("llama", "qwen2", "gpt2")
NEAR_TIE_GAP = 1e-3


@cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="kvserve-engine-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@cache
def tiny_model_path(arch: str, seed: int = 0) -> Path:
    """A 2-layer, hidden-64 model of ``arch``, written once per test process."""
    return init_tiny_model(_workdir() / f"{arch}-{seed}", arch, seed, layers=2, hidden=64)


@cache
def tiny_model(arch: str) -> Model:
    return load_model(tiny_model_path(arch))


def random_tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def top2_gap(logits: torch.Tensor) -> float:
    """Difference between the two largest logits of a [vocab] tensor."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def assert_greedy_matches(
    got: Sequence[int], oracle: Sequence[int], oracle_logits: Sequence[torch.Tensor], gap: float = NEAR_TIE_GAP
) -> None:
    """``got`` equals the oracle's greedy tokens; a mismatch is allowed only at a near-tie step
    (oracle top-2 logit gap < ``gap``), after which the sequences may diverge."""
    for step, (a, b) in enumerate(zip(got, oracle, strict=False)):
        if a != b:
            step_gap = top2_gap(oracle_logits[step])
            assert step_gap < gap, f"step {step}: got {a}, oracle {b}, oracle top-2 gap {step_gap:.2e}"
            return
    assert len(got) >= len(oracle), f"got {len(got)} tokens, oracle {len(oracle)}"


# ---- running sequences on an Engine ----------------------------------------------------------


def make_engine(
    model: Model, block_size: int, num_blocks: int, *, max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
    on_step: Callable[[StepStats], None] | None = None,
) -> Engine:
    """An Engine whose KV cache holds exactly ``num_blocks`` blocks."""
    per_block = KVCache.bytes_per_block(
        num_layers=model.num_layers, block_size=block_size, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=model.dtype,
    )
    engine = Engine(model, block_size, kv_cache_memory=num_blocks * per_block, on_step=on_step,
                    config=SchedulerConfig(max_num_batched_tokens, max_num_seqs))
    assert engine.pool.num_blocks == num_blocks
    return engine


def make_seq(
    model: Model, prompt: Sequence[int], max_new_tokens: int, params: SamplingParams | None = None, **kwargs: Any
) -> KVSequence:
    """A sequence sampling with ``params`` (greedy by default) on the model's device; ``kwargs`` go to Sequence."""
    return KVSequence(list(prompt), Sampler(params or SamplingParams(), model.device), max_new_tokens, **kwargs)


@dataclass(frozen=True, slots=True)
class Outcome:
    tokens: list[int]
    finished: Finished


def collect(seq: KVSequence, timeout_s: float = 30.0) -> Outcome:
    """The tokens ``seq`` streamed, up to its Finished event (which may follow a save on an I/O thread)."""
    tokens: list[int] = []
    while True:
        event = seq.events.get(timeout=timeout_s)
        if isinstance(event, Finished):
            return Outcome(tokens, event)
        tokens.append(event.token_id)


def finish(engine: Engine, seqs: Sequence[KVSequence]) -> list[Outcome]:
    """Step ``engine`` until every sequence finished; their outcomes, after checking that the pool is
    intact and that no block is left in use."""
    engine.run_until_done(timeout_s=120)
    outcomes = [collect(seq) for seq in seqs]
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0, f"{engine.pool.num_used} blocks still in use"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return outcomes


def run(engine: Engine, seqs: Sequence[KVSequence]) -> list[Outcome]:
    """Add ``seqs`` together, then ``finish`` them."""
    for seq in seqs:
        engine.add(seq)
    return finish(engine, seqs)


@cache
def stock_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The model at ``path`` as Hugging Face loads it, for the oracle: an engine runs its own copy through its
    own kernels (engine.packed_linear), so ``model.hf_model`` is no oracle once an engine has it."""
    model: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.to(device).eval()


def oracle(model: Model, token_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Hugging Face ``generate`` on ``token_ids`` alone, greedy, EOS ignored: its tokens and the logits [vocab]
    of each step."""
    input_ids = torch.tensor([list(token_ids)], device=model.device)
    # EOS off as a keyword: in a GenerationConfig, None means "the model's default". An explicit mask:
    # generate would otherwise mask every prompt token equal to pad_token_id.
    with torch.inference_mode():
        out = stock_model(model.path, model.dtype, model.device).generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(token_ids) :].tolist()
    assert len(tokens) == max_new_tokens, f"the oracle stopped after {len(tokens)} of {max_new_tokens} tokens"
    return tokens, [step[0] for step in out.logits]


def assert_matches_oracle(
    model: Model, seq: KVSequence, outcome: Outcome, gap: float = NEAR_TIE_GAP
) -> None:
    """``seq`` ran to its length and streamed what Hugging Face ``generate`` gives for its prompt alone."""
    assert outcome.finished == Finished("length"), outcome.finished
    assert len(outcome.tokens) == seq.max_new_tokens
    assert outcome.tokens == seq.output_token_ids
    tokens, logits = oracle(model, seq.token_ids[: seq.num_prompt_tokens], seq.max_new_tokens)
    assert_greedy_matches(outcome.tokens, tokens, logits, gap)


# ---- a KV store in a dict, and a KV source over it ---------------------------------------------


class DictStore:
    """A KVStoreLike in a dict: what a KV source needs of the KV store."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, bytes] = {}
        self._lock = threading.Lock()

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        with self._lock:
            return [self.blocks.get(h) for h in hashes]

    def put(self, blocks: Iterable[tuple[BlockHash, EncodedBlock]], ephemeral: bool = False) -> int:
        with self._lock:
            n = 0
            for key, payload in blocks:
                self.blocks[key] = encoded_bytes(payload)
                n += 1
            return n

    def remove(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            return sum(self.blocks.pop(h, None) is not None for h in hashes)


@dataclass(frozen=True, slots=True)
class Load:
    seq_id: int
    first_block: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Save:
    seq_id: int
    first_block: int
    kv: torch.Tensor  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    num_tokens: int


class PrefixSource:
    """A KVSource over a KVStoreLike, full blocks keyed by the prefix hashes of the sequence's tokens in
    ``namespace`` (whatever the sequence's own ``hash_root``): a preempted sequence resumes from what it
    saved, and a later sequence with the same prefix loads it. Records every load and save."""

    def __init__(self, store: DictStore, namespace: Namespace) -> None:
        self.store = store
        self.namespace = namespace
        self.loads: list[Load] = []
        self.saves: list[Save] = []
        self._lock = threading.Lock()

    def keys(self, token_ids: Sequence[int]) -> list[BlockHash]:
        return prefix_hashes(token_ids, self.namespace.block_size, self.namespace.root())

    def load(self, seq: KVSequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        keys = self.keys(seq.token_ids[:-1])[first_block:]  # the last token is always computed
        loaded = load_blocks(self.store, keys, self.namespace, cache, blocks)
        with self._lock:
            self.loads.append(Load(seq.seq_id, first_block, loaded.num_tokens))
        return loaded.num_tokens

    def save(self, seq: KVSequence, first_block: int, kv: Sequence[torch.Tensor], num_tokens: int) -> None:
        keys = self.keys(seq.token_ids[: first_block * self.namespace.block_size + num_tokens])[first_block:]
        save_blocks(self.store, keys, self.namespace, kv, num_tokens)
        with self._lock:  # a copy: the KV cache's slots are valid only during the call
            self.saves.append(Save(seq.seq_id, first_block, torch.stack(list(kv)), num_tokens))


class GatedSource(PrefixSource):
    """A PrefixSource whose saves wait for ``gate``: the engine goes on while a save is in flight."""

    def __init__(self, store: DictStore, namespace: Namespace) -> None:
        super().__init__(store, namespace)
        self.gate = threading.Event()

    def save(self, seq: KVSequence, first_block: int, kv: Sequence[torch.Tensor], num_tokens: int) -> None:
        assert self.gate.wait(30.0), "the test never opened the gate"
        super().save(seq, first_block, kv, num_tokens)
