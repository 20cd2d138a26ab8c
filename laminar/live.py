"""The live view of `laminar train`: one panel redrawn in place on a terminal, plain lines
everywhere else (a log file, CI, a pipe).

    with LiveView(cfg.trainer.total_steps, cfg.metrics.live) as view:
        ...
        view.row(record)          # every metrics row as written (MetricsLogger.write's return)
        view.update(LiveState(step, [RolloutLine(...), ...], [("master", 12), ...]))

Live: a progress bar of trainer steps with ETA; a line per rollout (version, running/waiting,
KV-utilisation bar, tokens/s, state); the trainer's newest step row (reward, held-out score,
loss, staleness histogram, push stall; the off-policy line: mismatch, ratio p99, masked share,
entropy); the relay chain with the version each relay holds; the
last few events. Redrawn at most 4 times a second however often it is fed (the driver polls
every 0.5 s), with no thread of its own, so feeding it costs a dict update.

Plain: one line per step row (the console line of laminar/metrics.py, plus the newest held-out
score), per evaluation and per event; `update` prints nothing. No terminal control codes, so a
redirected log reads like the console.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from laminar.metrics import CONSOLE

LiveMode = Literal["auto", "on", "off"]
REFRESH_S = 0.25  # at most 4 redraws a second
EVENTS_SHOWN = 5
STATE_STYLE = {"running": "green", "generating": "green", "idle": "yellow", "draining": "cyan",
               "held": "magenta",
               "pulling": "blue", "eval": "blue", "dead": "red"}


@dataclass(slots=True)
class RolloutLine:
    """One rollout as the panel shows it (from its RolloutSnapshot and counters)."""

    rollout_id: str
    version: int  # weights its engine holds
    running: int  # in the decode batch
    waiting: int  # admitted, not yet prefilled
    kv_util: float  # KV cache in use, 0..1
    tokens_per_s: float | None  # generation rate since the previous update; None = unknown yet
    state: str  # running, idle, draining, held, ... (coloured when known, shown as given)


@dataclass(slots=True)
class LiveState:
    """What the metrics rows do not carry: the fleet right now."""

    step: int  # trainer steps done (may be ahead of the newest step row)
    rollouts: list[RolloutLine] = field(default_factory=list)
    chain: list[tuple[str, int | None]] = field(default_factory=list)  # relay id, newest
    # version it holds (None: nothing yet), master first


def is_terminal(file: IO[str]) -> bool:
    """A terminal that can redraw in place (not a file, a pipe, or TERM=dumb). Not rich's own
    test, which also says yes when FORCE_COLOR is set, as in many CI logs."""
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def step_line(record: dict[str, Any], total_steps: int, heldout: float | None = None) -> str:
    """The console line of one step row (MetricsLogger.log's, the columns of CONSOLE), with
    the newest held-out greedy exact match when there is one."""
    cols = [f"{name} {record[key]:{spec}}" for name, key, spec in CONSOLE
            if record.get(key) is not None]
    if heldout is not None:
        cols.append(f"held-out {heldout:.2f}")
    return f"step {record['step']:>4}/{total_steps} | " + " | ".join(cols)


def eval_line(record: dict[str, Any]) -> str:
    return (f"held-out (version {record.get('version')}, step {record.get('step')}): greedy exact "
            f"{fmt(record.get('greedy_exact_match'), '.2f')}, sampled "
            f"{fmt(record.get('sampled_exact_match'), '.2f')}, reward "
            f"{fmt(record.get('greedy_reward'), '.2f')} ({record.get('num_prompts', '?')} prompts, "
            f"{fmt(record.get('eval_s'), '.1f')} s)")


def event_line(record: dict[str, Any]) -> str:
    return f"laminar: {record.get('what', '?')}: {record.get('detail', '')}"


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def bar(fraction: float, width: int = 10) -> str:
    filled = round(min(1.0, max(0.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


class LiveView:
    """`mode`: "on" always draws the panel, "off" always prints lines, "auto" draws only when
    the console is a terminal. `console_file`: where it goes (default stdout), a file or a
    rich Console (tests pass Console(file=StringIO(), force_terminal=True))."""

    def __init__(self, total_steps: int, mode: LiveMode = "auto",
                 console_file: IO[str] | Console | None = None) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"metrics.live={mode!r}: use auto, on or off")
        self.total_steps = total_steps
        given = console_file if isinstance(console_file, Console) else None
        self.file: IO[str] = given.file if given else (console_file or sys.stdout)
        terminal = given.is_terminal if given else is_terminal(self.file)
        self.is_live = mode == "on" or (mode == "auto" and terminal)
        self.console = given or Console(file=self.file,
                                        force_terminal=True if mode == "on" else None)
        self.last_step: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        self.events: deque[str] = deque(maxlen=EVENTS_SHOWN)
        self.state = LiveState(step=0)
        self.first: tuple[float, int] | None = None  # (time, step) of the first step row seen
        self.drawn = 0.0
        self.live: Live | None = None

    # ------------------------------------------------------------------------- lifetime

    def __enter__(self) -> LiveView:  # noqa: PYI034 (final class in all but name)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.is_live and self.live is None:
            # stdout is taken over (other prints appear above the panel) only when it is ours
            ours = self.file is sys.stdout
            self.live = Live(self.render(), console=self.console, auto_refresh=False,
                             redirect_stdout=ours, redirect_stderr=ours)
            self.live.start(refresh=True)
            self.drawn = time.monotonic()

    def stop(self) -> None:
        if self.live is not None:
            self.live.update(self.render())  # the final frame stays on screen
            self.live.stop()
            self.live = None

    # ------------------------------------------------------------------------- feeding

    def row(self, record: dict[str, Any]) -> None:
        """One metrics row as written (kinds step, eval, event; spans are ignored)."""
        kind = record.get("kind", "step")
        if kind == "step":
            self.last_step = record
            if self.first is None:
                self.first = (float(record.get("time", 0.0)), int(record["step"]))
            heldout = self.last_eval.get("greedy_exact_match") if self.last_eval else None
            line = step_line(record, self.total_steps, heldout)
        elif kind == "eval":
            self.last_eval = record
            line = eval_line(record)
        elif kind == "event":
            line = event_line(record)
            self.events.append(f"{record.get('time', 0.0):7.1f}s  {line.removeprefix('laminar: ')}")
        else:
            return
        if self.is_live:
            self.redraw()
        else:
            print(line, file=self.file, flush=True)

    def update(self, state: LiveState) -> None:
        """The fleet right now; redraws the panel (nothing in plain mode)."""
        self.state = state
        if self.is_live:
            self.redraw()

    def redraw(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.live is None or (not force and now - self.drawn < REFRESH_S):
            return  # the next call (or stop) draws what changed meanwhile
        self.drawn = now
        self.live.update(self.render(), refresh=True)

    # ------------------------------------------------------------------------- drawing

    def render(self) -> Panel:
        parts: list[Any] = [self._progress()]
        if self.state.rollouts:
            parts.append(self._rollouts())
        parts += [self._trainer(), self._staleness(), self._offpolicy()]
        if self.state.chain:
            parts.append(self._chain())
        if self.events:
            parts.append(Text("events", style="bold"))
            parts += [Text("  " + e, overflow="ellipsis", no_wrap=True) for e in self.events]
        return Panel(Group(*parts), title="laminar train", title_align="left")

    def _step(self) -> int:
        logged = int(self.last_step["step"]) if self.last_step else 0
        return max(self.state.step, logged)

    def _eta(self) -> str:
        if self.first is None or self.last_step is None:
            return "ETA -"
        t0, s0 = self.first
        done = int(self.last_step["step"]) - s0
        elapsed = float(self.last_step.get("time", t0)) - t0
        if done <= 0 or elapsed <= 0:
            return "ETA -"
        left = max(0, self.total_steps - self._step())
        return "done" if left == 0 else f"ETA {duration(left * elapsed / done)}"

    def _progress(self) -> Table:
        step = self._step()
        grid = Table.grid(padding=(0, 1))
        grid.add_row(Text("steps", style="bold"),
                     ProgressBar(total=max(1, self.total_steps),
                                 completed=min(step, self.total_steps), width=40),
                     Text(f"{step}/{self.total_steps}"), Text(self._eta(), style="cyan"))
        return grid

    def _rollouts(self) -> Table:
        table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
        for name, justify in (("rollout", "left"), ("state", "left"), ("version", "right"),
                              ("running", "right"), ("waiting", "right"), ("KV", "left"),
                              ("tok/s", "right")):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for r in self.state.rollouts:
            table.add_row(r.rollout_id, Text(r.state, style=STATE_STYLE.get(r.state, "")),
                          f"v{r.version}", str(r.running), str(r.waiting),
                          f"{bar(r.kv_util)} {r.kv_util:4.0%}", fmt(r.tokens_per_s, ",.0f"))
        return table

    def _trainer(self) -> Text:
        row = self.last_step or {}
        ev = self.last_eval
        heldout = ("-" if ev is None else
                   f"{fmt(ev.get('greedy_exact_match'), '.2f')} (v{ev.get('version')})")
        return Text(f"trainer  step {self._step()} | reward {fmt(row.get('reward'), '.3f')} | "
                    f"held-out {heldout} | loss {fmt(row.get('loss'), '+.4f')} | push stall "
                    f"{fmt(row.get('push_stall_s'), '.2f')} s")

    def _staleness(self) -> Text:
        hist = (self.last_step or {}).get("staleness_hist") or {}
        top = max(hist.values(), default=0)
        cells = [f"{k} {bar(n / top if top else 0.0, 8)} {n}" for k, n in hist.items()]
        return Text("staleness  " + ("   ".join(cells) if cells else "-"))

    def _offpolicy(self) -> Text:
        """The newest step's mismatch (docs/staleness.md): |log pi_trainer - log pi_behaviour|
        p99 over all trained tokens and over fresh ones, the ratio's p99, what was masked."""
        row = self.last_step or {}
        masked = row.get("correction_masked")
        return Text(f"off-policy  |Δlogp| p99 {fmt(row.get('logprob_abs_diff_all_p99'), '.2e')} "
                    f"(fresh {fmt(row.get('logprob_abs_diff_p99'), '.1e')}) | ratio p99 "
                    f"{fmt(row.get('is_ratio_p99'), '.2f')} | masked "
                    f"{'-' if masked is None else format(masked, '.1%')} | entropy "
                    f"{fmt(row.get('entropy'), '.2f')}")

    def _chain(self) -> Text:
        links = [f"{rid} {'-' if v is None else f'v{v}'}" for rid, v in self.state.chain]
        return Text("relays   " + " → ".join(links), overflow="fold")
