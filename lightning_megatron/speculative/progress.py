"""How far a speculative-decoding measurement is, for the person waiting on it: each pass's prompts done / total,
new tokens per second and the time left at that rate, on a text stream (the command's stderr)."""

from __future__ import annotations

import time
from typing import TextIO

from lightning_megatron.speculative.decode import Decoded


class Progress:
    """Prints a line at most every ``every_s`` seconds while a pass runs, and one when it ends; nothing at all
    without a ``stream`` (tests, library calls)."""

    def __init__(self, stream: TextIO | None, passes: int, prompts: int, *, every_s: float = 5.0) -> None:
        self.stream, self.passes, self.prompts, self.every_s = stream, passes, prompts, every_s
        self.number = 0
        self.name = ""
        self.started = self.last_line = 0.0
        self.done = self.tokens = 0

    def begin(self, name: str) -> None:
        self.number += 1
        self.name = name
        self.started = self.last_line = time.perf_counter()
        self.done = self.tokens = 0

    def finished(self, index: int, decoded: Decoded) -> None:
        """``decode_batch``'s ``on_finished``: one more prompt done."""
        self.done += 1
        self.tokens += len(decoded.tokens)
        if time.perf_counter() - self.last_line >= self.every_s:
            self._line(final=False)

    def end(self) -> None:
        self._line(final=True)

    def _line(self, final: bool) -> None:
        if self.stream is None:
            return
        now = time.perf_counter()
        self.last_line = now
        elapsed = max(now - self.started, 1e-9)
        rate = self.tokens / elapsed
        tail = (f"done in {elapsed:.1f} s" if final else
                f"about {elapsed * (self.prompts - self.done) / max(self.done, 1):.0f} s left of this pass")
        print(f"pass {self.number}/{self.passes}, {self.name}: {self.done}/{self.prompts} prompts, {self.tokens} "
              f"new tokens, {rate:.1f} tokens/s, {tail}", file=self.stream, flush=True)
