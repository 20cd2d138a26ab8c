"""What every Ray-based schedule's driver shares: the starting weights, following the trainer,
per-step metrics that join trainer and rollout numbers, and the final accounting."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from laminar.config import Config
from laminar.metrics import MetricsLogger, read_metrics, reward_trend
from laminar.runtime import Runtime


class Follower:
    """Turns trainer rows into metrics.jsonl lines, adding what the rollouts did meanwhile:
    generation tokens/s, rollout idle fraction, KV utilisation, pulls, repacks."""

    def __init__(self, rt: Runtime, cfg: Config) -> None:
        self.rt, self.cfg = rt, cfg
        self.logger = MetricsLogger(cfg.resolved_run_dir, cfg.trainer.total_steps,
                                    fresh=not cfg.trainer.resume)
        self.seen = 0
        self.last_t = time.monotonic()
        self.last_counters: dict[str, dict[str, Any]] = {}
        self.kv_samples: list[float] = []
        self.last_relay_check = time.monotonic()

    def poll(self) -> int:
        """Log the trainer rows that arrived since the last poll; returns how many. Every
        `relay.heartbeat_s` also checks the relay chain (and repairs it)."""
        if time.monotonic() - self.last_relay_check > self.cfg.relay.heartbeat_s:
            self.last_relay_check = time.monotonic()
            dead = self.rt.check_relays()
            if dead:
                print(f"laminar: relays {dead} died; the chain is now {list(self.rt.relays.plan.order)}",
                      flush=True)
        rows = ray.get(self.rt.trainer.metrics_since.remote(self.seen), timeout=self.cfg.cluster.wait_timeout_s)
        snaps = self.rt.worker_snapshots()
        self.kv_samples += [s["kv_used_tokens"] / s["kv_capacity_tokens"] for s in snaps.values()
                            if s["num_reqs"]]
        if not rows:
            return 0
        now = time.monotonic()
        wall, self.last_t = now - self.last_t, now
        gen, idle, pulls, pull_s = 0, 0.0, 0, 0.0
        for w, s in snaps.items():
            c, prev = s["counters"], self.last_counters.get(w)
            if prev is not None:
                gen += c["generated_tokens"] - prev["generated_tokens"]
                idle += c["idle_s"] - prev["idle_s"]
                pulls += c["pulls"] - prev["pulls"]
                pull_s += c["pull_s"] - prev["pull_s"]
            self.last_counters[w] = c
        manager = ray.get(self.rt.manager.stats.remote(), timeout=60)
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

    def follow(self, call: Callable[[], Any], started: Any = None, poll_s: float = 0.5) -> Any:
        """Run `call()` (it returns a trainer method's ref; `started`: one already made) and log
        rows until it finishes; returns its value. If the trainer dies meanwhile, Ray restarts it
        (it recovers from its newest checkpoint) and the call is made again; rollouts go on."""
        restarts = self.cfg.trainer.max_restarts
        ref = started if started is not None else call()
        while True:
            ready, _ = ray.wait([ref], timeout=poll_s)
            try:
                self.poll()
            except ray.exceptions.RayActorError:
                pass  # the trainer died or is restarting: the call in flight says which
            if not ready:
                continue
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError:
                if restarts == 0:
                    raise
                restarts -= 1
                print("laminar: the trainer died; it restarts from its newest checkpoint", flush=True)
                self.seen = 0  # the restarted actor keeps a fresh history
                ref = call()
                continue
            self.poll()
            return value


def finish(rt: Runtime, cfg: Config, running: list[Any]) -> dict[str, Any]:
    """Stop free-running loops and report where every leased prompt group ended up."""
    for w in rt.workers.values():
        w.stop.remote()
    rt.manager.stop.remote()
    ready, _ = ray.wait(running, num_returns=len(running), timeout=cfg.cluster.wait_timeout_s)
    for ref in running:
        try:
            ray.get(ref, timeout=0 if ref in ready else 1)
        except ray.exceptions.RayActorError:
            pass  # a worker that died or was retired; the manager's report says which
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError("a rollout loop did not stop within cluster.wait_timeout_s") from None
    accounting = ray.get(rt.pools["prompts"].accounting.remote())
    buffer = ray.get(rt.pools["buffer"].counts.remote())
    manager = ray.get(rt.manager.stats.remote())
    first, last = reward_trend(read_metrics(cfg.resolved_run_dir))
    report = {"prompts": accounting, "buffer": buffer, "manager": manager,
              "reward_first": first, "reward_last": last}
    (cfg.resolved_run_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"done: mean training reward {first:.3f} (first steps) -> {last:.3f} (last steps); "
          f"groups trained {accounting['consumed']}, repacks {manager['repacks']} "
          f"({cfg.resolved_run_dir})")
    return report
