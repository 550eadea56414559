"""Output for a person at a terminal: model text made safe to print, and progress that shows it is alive."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import TextIO

# Control characters (C0, DEL, C1) but newline and tab, as \xNN: a model's raw bytes must not move the cursor,
# clear the screen or set colours.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}

TICK_S = 0.5


def printable(text: str) -> str:
    """`text` with each control character other than newline and tab written as an escape (\\x1b)."""
    return text.translate(_ESCAPES)


class Progress:
    """Says what is happening, as a `progress` callback (stack.Stack's): a message that ends in "..." is a step
    under way, any other a line of output. On a terminal a step is one line, rewritten every TICK_S with the
    seconds it has taken and `note` (e.g. tokens so far), until the next message replaces it; elsewhere every
    message is a line of its own."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.note = ""
        self._step: str | None = None
        self._since = 0.0
        self._ticking = False
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        with self._lock:
            if self._step is not None:
                self.stream.write("\r\x1b[K")
            self._step = message if self.live and message.endswith("...") else None
            if self._step is None:
                print(message, file=self.stream, flush=True)
                return
            self._since, self.note = time.monotonic(), ""
            self._draw()
            if not self._ticking:
                self._ticking = True
                threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._lock:
                if self._step is None:
                    self._ticking = False
                    return
                self._draw()

    def _draw(self) -> None:
        seconds = int(time.monotonic() - self._since)
        text = " ".join(s for s in (self._step, self.note, f"{seconds} s" if seconds else "") if s)
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r\x1b[K" + printable(text).replace("\n", " ")[:width])
        self.stream.flush()
