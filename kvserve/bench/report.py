"""What every `kvserve bench` command shares in its output: a progress bar on stderr, percentiles,
goals met or not, a table on stdout whose columns are keys of the JSON rows, the JSON file, and PNG
plots (matplotlib, Agg backend, imported only when a plot is asked for)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# ---- progress ---------------------------------------------------------------------------------


class Progress:
    """`label [#######-------] 3/10  12.4s` on one line of stderr, redrawn twice a second. Silent when
    stderr is not a terminal, or with `quiet`. Thread-safe: request threads call `step`."""

    WIDTH = 24

    def __init__(self, total: int, label: str = "", *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = not quiet and self.stream.isatty()
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.enabled:
            threading.Thread(target=self._tick, daemon=True, name="bench-progress").start()

    def step(self, n: int = 1, label: str | None = None) -> None:
        with self._lock:
            self.done = min(self.done + n, self.total)
            if label is not None:
                self.label = label
        self._draw()

    def phase(self, label: str) -> None:
        """Names what runs now, without a step."""
        self.step(0, label)

    def line(self) -> str:
        filled = self.WIDTH * self.done // self.total
        return (f"{self.label} [{'#' * filled}{'-' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                f"{time.monotonic() - self._start:6.1f}s")

    def _draw(self) -> None:
        if self.enabled:
            with self._lock:
                self.stream.write(f"\r{self.line()}\x1b[K")
                self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._draw()

    def close(self) -> None:
        """Stops redrawing and clears the line."""
        self._stop.set()
        if self.enabled:
            with self._lock:
                self.stream.write("\r\x1b[K")
                self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- figures ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default); NaN of nothing."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def percentiles_s(name: str, values: Sequence[float]) -> dict[str, float | None]:
    """`{name}_p50_s`, `_p90_s` and `_p99_s` of seconds; None where there are no values."""
    return {f"{name}_p{q}_s": percentile(values, q) if values else None for q in (50, 90, 99)}


def goal(value: float, limit: float, *, at_most: bool) -> dict[str, Any]:
    """A goal as JSON: the measured value, the limit, and whether the value is within it."""
    return {"value": value, "goal": limit, "met": value <= limit if at_most else value >= limit}


def goal_line(text: str, g: Mapping[str, Any]) -> str:
    return f"goal: {text}: {'met' if g['met'] else 'NOT met'} (x{g['value']:.2f})"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- tables -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: `key` of the JSON rows, its header, and how a value is shown (`scale` 1000
    shows seconds as milliseconds; `left` aligns names). None shows as "-"."""

    key: str
    header: str
    fmt: str = "{:.1f}"
    scale: float = 1.0
    left: bool = False

    def cell(self, value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return self.fmt.format(value * self.scale if self.scale != 1 else value)
        return self.fmt.format(value)


def format_table(columns: Sequence[Column], rows: Sequence[Mapping[str, Any]]) -> str:
    cells = [[c.header for c in columns], *([c.cell(row.get(c.key)) for c in columns] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) if c.left else v.rjust(w) for c, v, w in zip(columns, line, widths, strict=True))
                     .rstrip() for line in cells)


# ---- output flags, JSON -----------------------------------------------------------------------


def add_output_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="write every figure and the settings as JSON to PATH (- prints it instead of the table)")
    ap.add_argument("--plot", metavar="PATH", type=Path, default=None,
                    help="draw the figures as a PNG at PATH (needs matplotlib: pip install -e '.[bench]'); "
                         "default: no plot")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (it is drawn only on a terminal)")


def write_json(path: str, report: Mapping[str, Any]) -> None:
    """The report as JSON at `path`, or on stdout for "-"."""
    text = json.dumps(report, indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")


def emit(args: argparse.Namespace, report: Mapping[str, Any], text: str, panels: Callable[[], list[Panel]],
         title: str) -> None:
    """The table (unless the JSON goes to stdout), the JSON file and the plot, as the flags ask."""
    if args.json != "-":
        print(text)
    if args.json:
        write_json(args.json, report)
    if args.plot:
        save_plot(args.plot, title, panels())


# ---- plots ------------------------------------------------------------------------------------

Panel = Callable[["Axes"], None]


class Line(NamedTuple):
    label: str
    x: Sequence[float]
    y: Sequence[float | None]
    dashed: bool = False


def line_panel(title: str, xlabel: str, ylabel: str, lines: Sequence[Line]) -> Panel:
    """Lines over shared x values (dashed ones, the baselines, without markers)."""
    def draw(ax: Axes) -> None:
        for line in lines:
            ys = [float("nan") if y is None else y for y in line.y]
            ax.plot(line.x, ys, "--" if line.dashed else "-", marker=None if line.dashed else "o", label=line.label)
        ax.set_xticks(sorted({x for line in lines for x in line.x}))
        ax.get_xaxis().set_major_formatter("{x:g}")
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return draw


def bar_panel(title: str, ylabel: str, bars: Mapping[str, float], *,
              spread: Mapping[str, tuple[float, float]] | None = None, ref: tuple[str, float] | None = None) -> Panel:
    """Bars by label; `spread` draws (low, high) whiskers; `ref` a labelled horizontal line."""
    def draw(ax: Axes) -> None:
        labels, heights = list(bars), list(bars.values())
        yerr = None
        if spread:
            yerr = [[h - spread[k][0] for k, h in bars.items()], [spread[k][1] - h for k, h in bars.items()]]
        ax.bar(labels, heights, yerr=yerr, capsize=6, color=[f"C{i}" for i in range(len(labels))])
        if ref:
            ax.axhline(ref[1], color="black", linestyle="--", label=ref[0])
            ax.legend()
        ax.set(title=title, ylabel=ylabel)
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(alpha=0.3, axis="y")
    return draw


def save_plot(path: Path, title: str, panels: Sequence[Panel]) -> None:
    """The panels side by side in one PNG, drawn by matplotlib's Agg canvas (no display, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * len(panels), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    for draw, ax in zip(panels, fig.subplots(1, len(panels), squeeze=False)[0], strict=True):
        draw(ax)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
