"""The baseline of ``kvserve bench decode``: Hugging Face ``generate`` on the same prompts as one padded batch.

No serving at all: one process, the model loaded with ``from_pretrained``, greedy, EOS ignored, exactly
``--new-tokens`` per prompt. For each concurrency N of ``--streams``, the first N prompts run as one
left-padded batch (all prompts of the same length need no padding) and the wall time of the whole
``generate`` call is measured, prompt processing included, as the stack's time is. The prompts come
as a JSON list of token-id lists (``--prompts FILE``, ``-`` for stdin), so that the caller's stack
runs exactly the same ones. The same prompts then run through kvserve's engine alone, in this process
(no services, no gRPC), so that a run shows how much of the gap to HF is the engine's and how much the
serving around it. Prints one JSON object (``kvserve.bench.decode`` reads it)::

    python -m bench.hf_batch --model data/models/tiny-llama --prompts prompts.json --streams 1,4,16

Both run on ``--device`` in ``--dtype``, as the services do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel

from kvserve.bench.prefill import parse_baseline_args
from kvserve.engine.engine import Engine
from kvserve.engine.model import load_model, synchronize
from kvserve.engine.sampling import Sampler, SamplingParams
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.engine.sequence import Sequence

PAD_TOKEN_ID = 0  # any id: padded positions are masked out


def padded_batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and their attention mask, both [batch, longest prompt]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def generate(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy ``generate`` of exactly ``new_tokens`` per prompt, as one batch: (new tokens per prompt, seconds)."""
    # EOS ignored as the stack ignores it: generate fills a None eos_token_id from the model's own
    # generation_config (and would then stop or pad after EOS), so it is cleared there. Not
    # min_new_tokens either: that masks EOS out of the logits, which is not greedy decoding.
    model.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD_TOKEN_ID)
    ids, mask = (t.to(model.device) for t in padded_batch(prompts))
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config)  # type: ignore[operator]
    synchronize(model.device)
    seconds = time.perf_counter() - start
    tokens = out[:, ids.shape[1]:].tolist()
    if any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"generate returned {[len(t) for t in tokens]} new tokens, not {new_tokens} each")
    return tokens, seconds


def engine_generate(model_dir: Path, prompts: list[list[int]], new_tokens: int, device: str = "cpu",
                    dtype: str = "auto") -> tuple[list[list[int]], float]:
    """The same, through kvserve's Engine in this process: (new tokens per prompt, seconds)."""
    model = load_model(model_dir, device, dtype)
    engine = Engine(model, config=SchedulerConfig(max(2048, len(prompts)), max(64, len(prompts))))
    seqs = [Sequence(p, Sampler(SamplingParams(), model.device), max_new_tokens=new_tokens) for p in prompts]
    synchronize(model.device)
    start = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    engine.run_until_done()
    synchronize(model.device)
    seconds = time.perf_counter() - start
    return [seq.token_ids[len(p):] for seq, p in zip(seqs, prompts, strict=True)], seconds


def read_prompts(path: str) -> list[list[int]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    prompts = json.loads(text)
    if not (isinstance(prompts, list) and prompts and all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
        raise SystemExit("--prompts must hold a non-empty JSON list of non-empty lists of token ids")
    return prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="local Hugging Face model folder")
    ap.add_argument("--prompts", required=True, help="JSON file of token-id lists; - reads stdin")
    ap.add_argument("--streams", default="1,4,16,64", help="batch sizes, comma-separated (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default %(default)s)")
    args = parse_baseline_args(ap, argv)
    levels = [int(n) for n in args.streams.split(",")]
    prompts = read_prompts(args.prompts)
    if max(levels) > len(prompts):
        raise SystemExit(f"--streams asks for {max(levels)} prompts; --prompts holds {len(prompts)}")

    model = load_model(args.model, args.device, args.dtype).hf_model
    runs = []
    for n in levels:
        generate(model, prompts[:n], 2)  # warm-up, untimed: the first forwards of this batch size
        tokens, seconds = generate(model, prompts[:n], args.new_tokens)
        generated = sum(len(t) for t in tokens)
        ours, engine_s = engine_generate(args.model, prompts[:n], args.new_tokens, args.device, args.dtype)
        runs.append({"streams": n, "generated_tokens": generated, "s": seconds, "tok_s": generated / seconds,
                     "token_ids": tokens, "engine_s": engine_s, "engine_tok_s": sum(map(len, ours)) / engine_s,
                     "engine_same_tokens": sum(a == b for a, b in zip(ours, tokens, strict=True))})
    print(json.dumps({"torch_threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
