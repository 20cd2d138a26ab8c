"""What every schedule's driver shares: following the trainer while logging per-step metrics
that join trainer and rollout numbers, and the final accounting. Talks to the runtime only
through its driver API (laminar/runtime/__init__.py), so it runs on either backend."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from laminar.metrics import MetricsLogger, read_metrics, reward_trend
from laminar.runtime import TrainerRestarted


class Follower:
    """Turns trainer rows into metrics.jsonl lines, adding what the rollouts did meanwhile:
    generation tokens/s, rollout idle fraction, KV utilisation, pulls, repacks."""

    def __init__(self, rt: Any) -> None:
        self.rt, self.cfg = rt, rt.cfg
        self.logger = MetricsLogger(self.cfg.resolved_run_dir, self.cfg.trainer.total_steps,
                                    fresh=not self.cfg.trainer.resume)
        self.seen = 0
        self.last_t = time.monotonic()
        self.last_counters: dict[str, Any] = {}
        self.kv_samples: list[float] = []
        self.chain: list[str] | None = None

    def poll(self) -> int:
        """Log the trainer rows that arrived since the last poll; returns how many."""
        rows = self.rt.trainer_rows(self.seen)
        snaps = self.rt.snapshots()
        self.kv_samples += [s.kv_utilization for s in snaps.values() if s.num_in_flight]
        if not rows:
            return 0
        now = time.monotonic()
        wall, self.last_t = now - self.last_t, now
        gen, idle, pulls, pull_s = 0, 0.0, 0, 0.0
        for w, s in snaps.items():
            c, prev = s.counters, self.last_counters.get(w)
            if prev is not None:
                gen += c.generated_tokens - prev.generated_tokens
                idle += c.idle_s - prev.idle_s
                pulls += c.pulls - prev.pulls
                pull_s += c.pull_s - prev.pull_s
            self.last_counters[w] = c
        manager = self.rt.manager_stats()
        if self.chain is not None and manager["chain"] != self.chain:
            print(f"laminar: the relay chain is now {manager['chain']} (was {self.chain})", flush=True)
        self.chain = manager["chain"]
        extra = {
            "gen_tokens_per_s": gen / wall if wall > 0 else None,
            "rollout_idle_frac": idle / (wall * max(1, len(snaps))) if wall > 0 else None,
            "kv_util_mean": float(np.mean(self.kv_samples)) if self.kv_samples else 0.0,
            "pulls": pulls, "pull_latency_s": pull_s / pulls if pulls else None,
            "repacks": manager["repacks"], "moved_trajectories": manager["moved_trajectories"],
        }
        self.kv_samples = []
        for row in rows:
            row = {**row, **extra}
            step_s = row.get("update_interval_s")
            row["trainer_idle_frac"] = row["trainer_idle_s"] / step_s if step_s else None
            self.logger.log(row["version"], row)
        self.seen += len(rows)
        return len(rows)

    def _await_trainer(self) -> None:
        """Until the restarted trainer answers (a call made before would fail at once)."""
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        while True:
            try:
                self.rt.trainer_rows(0)
                return
            except TrainerRestarted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def follow(self, call: Callable[[], Any], started: Any = None, poll_s: float = 0.5) -> Any:
        """Run `call()` (it starts a trainer call; `started`: one already made) and log rows
        until it finishes; returns its value. If the trainer dies meanwhile, it restarts from
        its newest checkpoint and the call is made again; rollouts go on."""
        restarts = self.cfg.trainer.max_restarts
        pending = started if started is not None else call()
        while True:
            ready = self.rt.ready(pending, poll_s)
            try:
                self.poll()
            except TrainerRestarted:
                pass  # the call in flight says what happened
            if not ready:
                continue
            try:
                value = self.rt.result(pending)
            except TrainerRestarted:
                if restarts == 0:
                    raise
                restarts -= 1
                print("laminar: the trainer died; it restarts from its newest checkpoint", flush=True)
                self._await_trainer()
                self.seen = 0  # the restarted trainer keeps a fresh history
                pending = call()
                continue
            self.poll()
            return value


def finish(rt: Any) -> dict[str, Any]:
    """Stop the loops and report where every leased prompt group ended up."""
    cfg = rt.cfg
    report = rt.finish()
    first, last = reward_trend(read_metrics(cfg.resolved_run_dir))
    report |= {"reward_first": first, "reward_last": last}
    (cfg.resolved_run_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    evaluated = ""
    if "after_eval_exact_match" in report:
        evaluated = (f"; held-out exact match {report['before_eval_exact_match']:.2f} -> "
                     f"{report['after_eval_exact_match']:.2f}, reward {report['before_eval_reward']:.3f}"
                     f" -> {report['after_eval_reward']:.3f}")
    print(f"done: mean training reward {first:.3f} (first steps) -> {last:.3f} (last steps); groups "
          f"trained {report['prompts']['consumed']}, repacks {report['manager']['repacks']}"
          f"{evaluated} ({cfg.resolved_run_dir})")
    return report
