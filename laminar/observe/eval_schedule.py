"""When the held-out evaluations run: at the start, every `trainer.eval_every` versions, every
`trainer.eval_every_s` seconds, and at the end; each by the next rollout in turn while training
goes on (laminar/rollout/evals.py runs them), asked again of another rollout if its own died or
left. Once per version: a version already asked for is not evaluated twice."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from laminar.rollout.evals import EvalJob
from laminar.rollout.requests import sampling_params
from laminar.runtime import Runtime


class EvalSchedule:
    def __init__(self, rt: Runtime) -> None:
        self.rt, self.cfg = rt, rt.cfg
        self.asked: dict[str, tuple[str | None, EvalJob]] = {}  # id -> (rollout, job)
        self.done: set[str] = set()
        self.next_clock = time.time() + self.cfg.trainer.eval_every_s  # trainer.eval_every_s
        self.newest_evaluated = -1  # the newest version an evaluation has reported on

    def ask(self, step: int, at_least: int) -> str:
        """Evaluate version `at_least` (or newer) as of update `step`; once per version."""
        eval_id = f"v{at_least}"
        if eval_id not in self.asked:
            job = EvalJob(eval_id, step, at_least, self.rt.task.eval, sampling_params(self.cfg))
            self.asked[eval_id] = (self.rt.request_eval(job), job)
        return eval_id

    def after_step(self, step: int, version: int) -> None:
        """trainer.eval_every: every so many updates (the final one is `final_eval`'s)."""
        every, total = self.cfg.trainer.eval_every, self.cfg.trainer.total_steps
        if every and step % every == 0 and step < total:
            self.ask(step=step, at_least=version)

    def on_clock(self, step: int, version: int) -> None:
        """trainer.eval_every_s: every so many wall-clock seconds, the newest version (once per
        version: a version already asked for is not evaluated twice)."""
        every = self.cfg.trainer.eval_every_s
        if every and time.time() >= self.next_clock:
            self.next_clock += every * max(1, int((time.time() - self.next_clock) // every) + 1)
            if version > self.newest_evaluated:  # an evaluation may have run on a newer one
                self.ask(step=step, at_least=version)

    def reported(self, result: Mapping[str, Any]) -> None:
        self.done.add(result["eval_id"])
        self.newest_evaluated = max(self.newest_evaluated, result["version"])

    def reassign(self, live: list[str]) -> list[tuple[str, str]]:
        """An evaluation whose rollout died or left is asked of another one; returns (eval id,
        the rollout it moved from) for each that found a new rollout."""
        moved = []
        for eval_id, (wid, job) in list(self.asked.items()):
            if eval_id not in self.done and wid not in live:
                self.asked[eval_id] = (new := self.rt.request_eval(job), job)
                if wid is not None and new is not None:
                    moved.append((eval_id, wid))
        return moved

    def missing(self) -> list[str]:
        """Asked and not reported yet."""
        return sorted(set(self.asked) - self.done)
