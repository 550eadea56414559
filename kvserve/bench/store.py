"""`kvserve bench store`: put/get bandwidth of a real KV store server process over loopback, against memcpy.

Runs `python -m bench.store_transfer --json` in a subprocess (the measurement: it starts the store as a process
of its own and measures memcpy of warm buffers, put and get through the same-host shared-memory path
and through plain gRPC bytes, and lookups per second; see its --help) and reports its figures and
goals as the other benchmarks do: a table, --json, --plot.

With `--device cuda` (or cpu), the store's device arena instead: `python -m bench.store_device`
measures put and the hand-off (get into pool slots) device to device against torch's copy of the same
bytes on that device (see its --help).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvserve.bench.isolated import run_module
from kvserve.bench.report import Column, Panel, Progress, add_output_flags, bar_panel, emit, format_table

COLUMNS = [
    Column("label", "path", "{}", left=True),
    Column("gbps", "GB/s", "{:.2f}"),
    Column("vs_memcpy", "x memcpy", "{:.2f}"),
]
DEVICE_COLUMNS = [*COLUMNS[:2], Column("vs_copy", "x copy", "{:.2f}")]


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


def device_report(measured: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The device bench's figures as rows (the device copy first), its goal, and the settings."""
    rows = [{"path": "copy", "label": "device copy (copy_, best)", "gbps": measured["gbps"]["copy"], "vs_copy": 1.0}]
    rows += [{"path": k, "label": label, "gbps": measured["gbps"][k], "vs_copy": measured["ratios"][k]}
             for k, label in measured["labels"].items()]
    return {"bench": "store", "settings": settings, "measured": measured, "rows": rows, "goals": measured["goals"]}


def device_report_text(r: dict[str, Any]) -> str:
    m = r["measured"]
    return "\n".join([
        f"kvstore device arena on {m['device']}: {m['total_bytes'] / 2**20:.0f} MiB in {m['blocks']} blocks of "
        f"{m['block_bytes'] / 2**10:.0f} KiB, {m['batch']} a call, through a kvstore server process",
        format_table(DEVICE_COLUMNS, r["rows"]),
        *(f"goal: {g['text']}: {'met' if g['met'] else 'NOT met'} (x{g['value']:.2f})" for g in r["goals"].values()),
    ])


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
    title = "KV store device arena" if "vs_copy" in memcpy else "KV store transfer over loopback"
    return [bar_panel(title, "GB/s (best of repeats)",
                      {row["path"]: row["gbps"] for row in paths}, ref=(memcpy["label"], memcpy["gbps"]))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvserve bench store", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="measure the store's device arena on this device instead (defaults: --total 1GiB, "
                         "--block-size 768KiB, a 16-token block of the ~0.6B benchmark model)")
    ap.add_argument("--total", default=None, help="bytes of blocks (default 256MiB)")
    ap.add_argument("--block-size", default=None, help="block size (default 256KiB)")
    ap.add_argument("--batch", type=int, default=64, help="blocks per put/get call (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N for every figure (default %(default)s)")
    add_output_flags(ap)
    args = ap.parse_args(argv)
    on_device = args.device is not None
    settings = {"total": args.total or ("1GiB" if on_device else "256MiB"),
                "block_size": args.block_size or ("768KiB" if on_device else "256KiB"),
                "batch": args.batch, "repeat": args.repeat, **({"device": args.device} if on_device else {})}
    if on_device:
        from kvserve.bench import store_device  # torch: only with --device

        module, what = store_device.__name__, "device copy, put, hand-off"
    else:
        from kvserve.bench import store_transfer

        module, what = store_transfer.__name__, "memcpy, put, get, lookups"
    with Progress(1, f"store: {what}", quiet=args.quiet) as progress:
        measured = run_module(module, [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()] + ["--json"])
        progress.step()
    r = device_report(measured, settings) if on_device else report(measured, settings)
    text = device_report_text(r) if on_device else report_text(r)
    emit(args, r, text, lambda: panels(r), "kvserve bench store")
    return 0


if __name__ == "__main__":
    sys.exit(main())
