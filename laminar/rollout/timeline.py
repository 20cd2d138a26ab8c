"""What a component was doing when: spans of one state each, for the run's timeline (the
report's Gantt chart, the paper's Fig. 3).

    tl = Timeline()
    tl.mark("generate", version=3)     # called often; a span closes only when the state changes
    tl.mark("idle", version=3)
    spans = tl.take()                  # closed spans since the last take: [Span, ...]

Times are Unix seconds (`time.time()`), so spans of different processes share one axis. A state
that lasts less than `min_s` is folded into the span before it, so a loop that naps for 2 ms
between steps does not write a row per nap.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass
class Span:
    what: str
    start: float
    end: float
    version: int | None = None

    def to_row(self, who: str) -> dict:
        return {"who": who, **asdict(self)}


class Timeline:
    def __init__(self, min_s: float = 0.02, keep: int = 10_000) -> None:
        self.min_s, self.keep = min_s, keep
        self.closed: list[Span] = []
        self.open: Span | None = None

    def mark(self, what: str, version: int | None = None, now: float | None = None) -> None:
        """The state from `now` on (default: the current time)."""
        now = time.time() if now is None else now
        cur = self.open
        if cur is not None and cur.what == what and cur.version == version:
            return
        if cur is not None:
            cur.end = now
            last = self.closed[-1] if self.closed else None
            if cur.end - cur.start < self.min_s and last is not None and last.end >= cur.start:
                last.end = now  # too short to show: the span before absorbs it
                if last.what == what and last.version == version:
                    self.open = self.closed.pop()  # and it goes on
                    return
            else:
                self.closed.append(cur)
                if len(self.closed) > self.keep:  # nobody is taking them: keep the newest
                    del self.closed[: len(self.closed) - self.keep]
        self.open = Span(what, now, now, version)

    def add(self, what: str, start: float, end: float, version: int | None = None) -> None:
        """A span measured by its caller (a weight pull); the open state resumes after it."""
        if self.open is not None:
            self.open.end = start
            if self.open.end > self.open.start:
                self.closed.append(self.open)
            self.open = Span(self.open.what, end, end, self.open.version)
        self.closed.append(Span(what, start, end, version))

    def take(self, close: bool = False) -> list[Span]:
        """The spans closed since the last take; `close`: the open one too (the run is over)."""
        if close and self.open is not None:
            self.open.end = time.time()
            if self.open.end > self.open.start:
                self.closed.append(self.open)
            self.open = None
        out, self.closed = self.closed, []
        return out
