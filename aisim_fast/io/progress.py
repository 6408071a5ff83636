"""Progress of long work on stderr: a tqdm bar on a terminal, plain lines every
``every_s`` seconds otherwise (logs of batch jobs), nothing with ``quiet``. Nothing is
shown before ``delay_s``: a run that ends sooner stays silent."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, *, desc: str, unit: str, done: int = 0, quiet: bool = False,
                 delay_s: float = 0.0, every_s: float = 10.0):
        self.total, self.desc, self.unit = total, desc, unit
        self.done, self.quiet, self.delay_s, self.every_s = done, quiet, delay_s, every_s
        self.start_s = time.perf_counter()
        self.last_line_s = self.start_s
        self.bar = None
        self.tty = sys.stderr.isatty()

    def update(self, done: int, note: str = "") -> None:
        """``done`` units so far (absolute), ``note`` e.g. a rate."""
        self.done = done
        if self.quiet:
            return
        now = time.perf_counter()
        if now - self.start_s < self.delay_s:
            return
        if self.tty:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, unit=self.unit, desc=self.desc, file=sys.stderr,
                                dynamic_ncols=True)
            self.bar.update(done - self.bar.n)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
        elif now - self.last_line_s >= self.every_s or done == self.total:
            self.last_line_s = now
            tail = f", {note}" if note else ""
            print(f"{self.desc}: {done}/{self.total} {self.unit}{tail}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
