"""The decode rows' attention read in place from the paged cache (engine.native's kernel, built with the host's C
compiler): equal to SDPA over the gathered blocks, taken by the engine on a CPU with tokens equal to Hugging
Face's, and the SDPA path kept where it cannot be built."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from kvserve.engine import native
from kvserve.engine.model_runner import MIN_SHARED_BLOCKS
from tests.engine_fixtures import (
    ARCHS,
    assert_matches_oracle,
    finish,
    make_engine,
    make_seq,
    random_tokens,
    run,
    tiny_model,
)

BLOCK = 16
MAX_NEW = 12

kernel = native.decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler here: the engine gathers for SDPA")


@needs_kernel
@pytest.mark.parametrize(("lens", "kv_heads", "group", "head_dim", "threads", "block"), [
    ([37], 4, 2, 64, 2, BLOCK),  # one row split in ranges, one per thread and more, its last block partly filled
    ([1, 16, 17, 200, 33], 2, 3, 12, 2, BLOCK),  # one token; a block's end; a head size not a multiple of 16
    ([48, 5], 1, 8, 32, 1, BLOCK),  # every query head on one KV head (16 to a vector from 8 on), one thread
    ([300, 20], 2, 4, 128, 2, BLOCK),  # the other head size the kernel is compiled for
    ([1000], 3, 12, 64, 2, BLOCK),  # four rows' queries over a prefix they share (SmolLM2's shape)
    ([70, 9], 2, 20, 64, 2, BLOCK),  # more queries than a vector holds
    ([45, 3], 2, 3, 64, 2, 12),  # another block size: a block's scores not one vector
    ([29], 1, 9, 64, 1, 12),
])
def test_in_place_attention_equals_sdpa_over_the_gathered_blocks(lens: list[int], kv_heads: int, group: int,
                                                                 head_dim: int, threads: int, block: int) -> None:
    assert kernel is not None
    g = torch.Generator().manual_seed(len(lens))
    layers, num_blocks = 3, 80
    kv = torch.randn(num_blocks, layers, 2, block, kv_heads, head_dim, generator=g)
    width = max(-(-n // block) for n in lens)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), kv_heads, group, head_dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = kernel(q, kv, 1, tables, torch.tensor(lens), 0.3)
    finally:
        torch.set_num_threads(before)
    for r, n in enumerate(lens):
        keys = kv[tables[r], 1, 0].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)  # [kv_heads, n, head_dim]
        values = kv[tables[r], 1, 1].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)
        scores = (q[r] @ keys.transpose(1, 2)) * 0.3  # [kv_heads, group, n]
        torch.testing.assert_close(out[r], torch.softmax(scores, -1) @ values)
        torch.testing.assert_close(lse[r], torch.logsumexp(scores, -1))


@needs_kernel
@pytest.mark.parametrize(("lens", "kv_heads", "group", "head_dim"), [
    ([37, 250], 3, 3, 64),  # SmolLM2's heads, one query a head
    ([1000], 3, 12, 64),  # rows over a prefix they share: 16 queries to a vector
    ([20, 3], 2, 3, 12),  # a head size not a multiple of 16
])
def test_a_bfloat16_cache_reads_as_its_values_in_float32(lens: list[int], kv_heads: int, group: int,
                                                         head_dim: int) -> None:
    """The same float32 arithmetic over each bfloat16 value widened (exactly): the outputs are those of the
    kernel over the cache converted to float32, whatever dtype the queries come in."""
    assert kernel is not None
    g = torch.Generator().manual_seed(len(lens))
    kv = torch.randn(80, 2, 2, BLOCK, kv_heads, head_dim, generator=g).bfloat16()
    width = max(-(-n // BLOCK) for n in lens)
    tables = torch.randperm(80, generator=g)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), kv_heads, group, head_dim, generator=g).bfloat16()
    out, lse = kernel(q, kv, 1, tables, torch.tensor(lens), 0.3)
    want_out, want_lse = kernel(q.float(), kv.float(), 1, tables, torch.tensor(lens), 0.3)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize(("lens", "table"), [
    ([0], [3]),  # a row with no token
    ([17], [3]),  # more tokens than its one block holds
    ([5], [8]),  # a block past the cache's end
    ([5], [-1]),
])
def test_the_kernel_reads_nothing_out_of_bounds(lens: list[int], table: list[int]) -> None:
    assert kernel is not None
    kv = torch.zeros(8, 2, 2, BLOCK, 1, 16)
    with pytest.raises(ValueError, match="outside its table or the cache"):
        kernel(torch.zeros(1, 1, 1, 16), kv, 0, torch.tensor([table]), torch.tensor(lens), 1.0)


@needs_kernel
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "gathered for SDPA"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_rows_over_a_shared_prompt_and_alone_equal_hf_generate(arch: str, in_place: bool) -> None:
    """Streams over a shared system prompt (the cascade: its blocks read once by all rows, each row's own in place)
    and a stream alone (its whole context in place), both ways; the prompts' chunks likewise (in place, or
    gathered for SDPA under their causal masks, as where the kernels cannot be built)."""
    model = tiny_model(arch)
    engine = make_engine(model, BLOCK, 256)
    assert engine.runner.in_place_decode and engine.runner.in_place_chunks  # a CPU with a compiler: the kernels
    engine.runner.in_place_decode = engine.runner.in_place_chunks = in_place
    root = engine.namespace().root()
    system = random_tokens((MIN_SHARED_BLOCKS + 2) * BLOCK + 3, seed=70)
    run(engine, [make_seq(model, system, 1, hash_root=root)])
    seqs = [make_seq(model, [*system, *random_tokens(n, seed=71 + n)], MAX_NEW, hash_root=root) for n in (4, 29)]
    alone = make_seq(model, random_tokens(45, seed=79), MAX_NEW)
    for seq in seqs:
        engine.add(seq)
    outcomes = finish(engine, seqs)
    outcomes += run(engine, [alone])
    for seq, outcome in zip([*seqs, alone], outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


@needs_kernel
def test_the_kernel_is_built_once_into_a_folder_of_this_users_alone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = os.environ.get("CC") or "cc"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    lib = native.build(compiler)
    assert lib.parent == tmp_path / "cache" and stat.S_IMODE(lib.parent.stat().st_mode) == 0o700
    built = lib.stat().st_mtime_ns
    assert native.build(compiler) == lib and lib.stat().st_mtime_ns == built  # found, not built again
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temporary file left
    lib.parent.chmod(0o777)  # others could put their code where it is loaded from
    with pytest.raises(RuntimeError, match="not private"):
        native.build(compiler)
