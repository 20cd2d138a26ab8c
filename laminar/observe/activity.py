"""What the rollouts did between two trainer rows, from their snapshots and records.

    activity.sample(snaps)                    # every poll: KV use of the rollouts decoding
    activity.add_records(rec)                 # environment latencies and turns
    fields = activity.row_fields(snaps, manager)   # once per batch of trainer rows: the rates
                                              # since the previous one, then start afresh
    activity.live_state(snaps, manager, steps)     # the live view's fleet lines
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from laminar.live import LiveState, RolloutLine
from laminar.metrics import evenly
from laminar.types import RolloutCounters, RolloutSnapshot


class RolloutActivity:
    def __init__(self) -> None:
        self.last_t = time.monotonic()  # when the previous trainer rows were logged
        self.last_counters: dict[str, RolloutCounters] = {}  # per rollout, as of then
        self.kv_samples: dict[str, list[float]] = {}
        self.env_latency: list[float] = []
        self.turns: list[int] = []  # turns of multi-turn episodes ended since the last row

    def sample(self, snaps: Mapping[str, RolloutSnapshot]) -> None:
        for w, snap in snaps.items():
            if snap.num_in_flight:
                self.kv_samples.setdefault(w, []).append(snap.kv_utilization)

    def add_records(self, record: Mapping[str, Any]) -> None:
        self.env_latency += record["env_latency_s"]
        self.turns += record.get("turns", [])

    def row_fields(self, snaps: Mapping[str, RolloutSnapshot], manager: Mapping[str, Any]) -> dict[str, Any]:
        """The keys every trainer row of this poll gets: what the rollouts did since the
        previous rows (rates over that wall time), then the samples start afresh."""
        now = time.monotonic()
        wall, self.last_t = now - self.last_t, now
        gen, idle, drain_idle, pulls, pull_s, gen_by = 0, 0.0, 0.0, 0, 0.0, {}
        drafted = accepted = spec_steps = lookups = hits = 0
        for w, s in snaps.items():
            c, prev = s.counters, self.last_counters.get(w)
            if prev is not None:
                gen_by[w] = (c.generated_tokens - prev.generated_tokens) / wall if wall > 0 else None
                gen += c.generated_tokens - prev.generated_tokens
                idle += c.idle_s - prev.idle_s
                drain_idle += c.drain_idle_s - prev.drain_idle_s
                pulls += c.pulls - prev.pulls
                pull_s += c.pull_s - prev.pull_s
                drafted += c.spec_drafted_tokens - prev.spec_drafted_tokens
                accepted += c.spec_accepted_tokens - prev.spec_accepted_tokens
                spec_steps += c.spec_steps - prev.spec_steps
                lookups += c.prefix_lookups - prev.prefix_lookups
                hits += c.prefix_hits - prev.prefix_hits
            self.last_counters[w] = c
        kv_all = [v for samples in self.kv_samples.values() for v in samples]
        fields = {
            "gen_tokens_per_s": gen / wall if wall > 0 else None,
            "gen_tokens_per_s_by_rollout": gen_by,
            "rollout_idle_frac": idle / (wall * max(1, len(snaps))) if wall > 0 else None,
            "rollout_drain_idle_frac": drain_idle / (wall * max(1, len(snaps))) if wall > 0 else None,
            "kv_util_mean": float(np.mean(kv_all)) if kv_all else 0.0,
            "kv_util_by_rollout": {w: float(np.mean(v)) for w, v in self.kv_samples.items() if v},
            "pulls": pulls, "pull_latency_s": pull_s / pulls if pulls else None,
            "spec_acceptance_rate": accepted / drafted if drafted else None,
            "spec_drafted_per_step": drafted / spec_steps if spec_steps else None,
            "spec_accepted_per_step": accepted / spec_steps if spec_steps else None,
            "prefix_hit_rate": hits / lookups if lookups else None,
            "repacks": manager["repacks"], "moved_trajectories": manager["moved_trajectories"],
            "env_latency_s": evenly(self.env_latency, 64),
            "turns": evenly(self.turns, 64),
            # cumulative over the live rollouts: failed trajectories by reason, tool calls by status
            "failed_by_reason": summed(s.counters.failed_by_reason for s in snaps.values()),
            "tool_calls": summed(s.counters.tool_calls for s in snaps.values()),
        }
        self.kv_samples, self.env_latency, self.turns = {}, [], []
        return fields

    def live_state(self, snaps: Mapping[str, RolloutSnapshot], manager: Mapping[str, Any],
                   steps: int) -> LiveState:
        """The live view's panel: each rollout now (its rate since the previous trainer rows)
        and the relay chain."""
        lines = []
        for w, s in sorted(snaps.items()):
            prev = self.last_counters.get(w)
            wall = max(1e-9, time.monotonic() - self.last_t)
            rate = (s.counters.generated_tokens - prev.generated_tokens) / wall if prev else 0.0
            state = "held" if s.held else "draining" if s.draining else "running" if s.num_in_flight else "idle"
            lines.append(RolloutLine(w, s.version, s.num_running, s.num_waiting, s.kv_utilization,
                                     rate, state))
        versions = manager.get("relay_versions", {})
        return LiveState(steps, lines, [(r, versions.get(r)) for r in manager["chain"]])


def summed(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total
