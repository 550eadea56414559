"""`kvserve bench store`: put/get bandwidth of a real KV store server process over loopback, against memcpy.

Runs `python -m kvstore.bench --json` in a subprocess (the measurement: it starts the store as a process
of its own and measures memcpy of warm buffers, put and get through the same-host shared-memory path
and through plain gRPC bytes, and lookups per second; see its --help) and reports its figures and
goals as the other benchmarks do: a table, --json, --plot.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from client.bench_report import Column, Panel, Progress, add_output_flags, bar_panel, emit, format_table
from client.bench_subprocess import run_module

COLUMNS = [
    Column("label", "path", "{}", left=True),
    Column("gbps", "GB/s", "{:.2f}"),
    Column("vs_memcpy", "x memcpy", "{:.2f}"),
]


def report(measured: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The store bench's figures as rows of the table (memcpy first), its goals, and the settings."""
    memcpy = measured["memcpy_gbps"]
    rows = [{"path": "memcpy", "label": "memcpy (warm buffers, best)", "gbps": memcpy, "vs_memcpy": 1.0},
            {"path": "block_memcpy", "label": "memcpy of the same blocks, one by one",
             "gbps": measured["block_memcpy_gbps"], "vs_memcpy": measured["block_memcpy_gbps"] / memcpy}]
    rows += [{"path": k, "label": label, "gbps": measured["gbps"][k], "vs_memcpy": measured["gbps"][k] / memcpy}
             for k, label in measured["labels"].items()]
    return {"bench": "store", "settings": settings, "measured": measured, "rows": rows,
            "lookups_per_s": measured["lookups_per_s"], "lookup_hashes": measured["lookup_hashes"],
            "goals": measured["goals"]}


def report_text(r: dict[str, Any]) -> str:
    m = r["measured"]
    return "\n".join([
        f"kvstore bench: {m['total_bytes'] / 2**20:.0f} MiB in {m['blocks']} blocks of {m['block_bytes'] / 2**10:.0f} "
        "KiB through a kvstore server process over loopback",
        format_table(COLUMNS, r["rows"]),
        f"lookups ({r['lookup_hashes']} hashes each): {r['lookups_per_s']:.0f} /s",
        *(f"goal: {g['text']}: {'met' if g['met'] else 'NOT met'} (x{g['value']:.2f}; "
          f"x{g['vs_block_memcpy']:.2f} memcpy of the same blocks)" for g in r["goals"].values()),
    ])


def panels(r: dict[str, Any]) -> list[Panel]:
    memcpy, *paths = r["rows"]
    return [bar_panel("KV store transfer over loopback", "GB/s (best of repeats)",
                      {row["path"]: row["gbps"] for row in paths}, ref=(memcpy["label"], memcpy["gbps"]))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve bench store", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", default="256MiB", help="bytes of blocks (default %(default)s)")
    ap.add_argument("--block-size", default="256KiB", help="block size (default %(default)s)")
    ap.add_argument("--batch", type=int, default=64, help="blocks per put/get call (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N for every figure (default %(default)s)")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    settings = {"total": args.total, "block_size": args.block_size, "batch": args.batch, "repeat": args.repeat}
    with Progress(1, "store: memcpy, put, get, lookups", quiet=args.quiet) as progress:
        measured = run_module("kvstore.bench", [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
                              + ["--json"])
        progress.step()
    r = report(measured, settings)
    emit(args, r, report_text(r), lambda: panels(r), "kvserve bench store")
    return 0


if __name__ == "__main__":
    sys.exit(main())
