"""The RL workload: prompt groups with response lengths drawn from the paper's Fig. 17.

Parts:
- `LengthDistribution`: inverse CDF through the digitised quantiles (p50, p90, p99, max),
  interpolated linearly in (normal z-score, log length) — a log-normal between neighbouring
  points — and extended below p50 with the p50-p90 slope; clipped to [min_len, max_len].
- `Traj`: one trajectory to generate (lengths known to the simulator, not to the schedules).
- `Workload`: draws prompt groups deterministically from a seed. The 16 samples of a prompt
  share a per-prompt difficulty: z = sqrt(rho) z_prompt + sqrt(1 - rho) z_sample, which keeps
  the marginal distribution exactly Fig. 17's while making hard prompts long together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

_Z = NormalDist().inv_cdf
_Q_MAX = 0.9999  # default quantile of a curve's "max" (about 10k samples behind it)


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    quantiles: tuple[tuple[float, float], ...]  # (probability, tokens), increasing
    min_len: int = 16
    max_len: int = 16384

    @classmethod
    def from_points(cls, points: dict[float, float], min_len: int = 16,
                    max_len: int = 16384, q_max: float = _Q_MAX) -> LengthDistribution:
        """q_max: the quantile a curve's "max" (probability 1.0) is placed at."""
        pts = sorted((min(q, q_max), v) for q, v in points.items())
        if len(pts) < 2 or any(b[1] < a[1] for a, b in zip(pts, pts[1:])):
            raise ValueError(f"length quantiles {points} must be >= 2 increasing points")
        return cls(tuple(pts), min_len, max_len)

    def from_z(self, z: np.ndarray) -> np.ndarray:
        zs = np.array([_Z(q) for q, _ in self.quantiles])
        logs = np.log([v for _, v in self.quantiles])
        out = np.interp(z, zs, logs)
        lo = z < zs[0]  # below the first point: extend the first segment's slope
        slope = (logs[1] - logs[0]) / (zs[1] - zs[0])
        out[lo] = logs[0] + (z[lo] - zs[0]) * slope
        return np.clip(np.rint(np.exp(out)), self.min_len, self.max_len).astype(np.int64)

    def quantile(self, q: float) -> int:
        return int(self.from_z(np.array([_Z(q)]))[0])


@dataclass(slots=True)
class Traj:
    traj_id: int
    group: int
    prompt_len: int
    target: int  # response tokens it will generate in total
    done: int = 0  # response tokens generated so far
    version: int = -1  # weight version of its first token (partial: of its latest segment)
    versions: int = 0  # distinct weight versions that generated it (partial mixes them)
    t_created: float = 0.0
    t_finished: float = -1.0
    # Simulator bookkeeping while on a replica (see replica.py).
    finish_step: int = 0
    admit_step: int = 0
    admit_done: int = 0
    serial: int = 0  # the replica's admission serial (validates its lazy entries)
    state: int = 0  # 0 waiting, 1 running, 2 finished, 3 removed, 4 in a tool call
    tool_at: tuple[int, ...] = ()  # response lengths at which it calls a tool (ascending)
    tool_s: tuple[float, ...] = ()  # each call's latency in seconds
    tool_i: int = 0  # calls made so far
    t_tool_return: float = -1.0  # while in a tool call: when the result comes back
    env_s: float = 0.0  # environment latency after the last token (off the engine)

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.target

    @property
    def next_stop(self) -> int:
        """Response length at which it next leaves the decode batch (tool call or end)."""
        return self.tool_at[self.tool_i] if self.tool_i < len(self.tool_at) else self.target



@dataclass(slots=True)
class Workload:
    lengths: LengthDistribution
    samples: int = 16  # GRPO group size
    group_corr: float = 0.5  # rho: share of log-length variance common to a prompt's samples
    prompt_median: float = 200.0
    prompt_sigma: float = 0.4
    max_prompt: int = 2048
    tool_calls: tuple[int, float, float] | None = None  # (max calls, median s, log sigma)
    env_latency: tuple[float, float, float] | None = None  # after the last token: (median
    # s, log sigma, max s) — a reward sandbox; the trajectory reaches the buffer after it
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)
    _next_group: int = field(default=0, init=False)
    _next_traj: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.group_corr <= 1.0:
            raise ValueError(f"group_corr={self.group_corr}: must be in [0, 1]")
        self._rng = np.random.default_rng(self.seed)

    def groups(self, n: int, now: float = 0.0) -> list[list[Traj]]:
        """n new prompt groups of `samples` trajectories each."""
        rng, s = self._rng, self.samples
        z = (math.sqrt(self.group_corr) * rng.standard_normal((n, 1))
             + math.sqrt(1.0 - self.group_corr) * rng.standard_normal((n, s)))
        targets = self.lengths.from_z(z.ravel()).reshape(n, s)
        prompts = np.clip(np.rint(self.prompt_median * np.exp(
            self.prompt_sigma * rng.standard_normal(n))), 8, self.max_prompt).astype(np.int64)
        out = []
        for g in range(n):
            gid = self._next_group
            self._next_group += 1
            members = []
            for k in range(s):
                tr = Traj(self._next_traj, gid, int(prompts[g]), int(targets[g, k]), t_created=now)
                if self.tool_calls is not None:
                    self._add_tool_calls(tr)
                if self.env_latency is not None:
                    median, sigma, cap = self.env_latency
                    tr.env_s = min(cap, median * float(np.exp(sigma * self._rng.standard_normal())))
                members.append(tr)
                self._next_traj += 1
            out.append(members)
        return out

    def _add_tool_calls(self, tr: Traj) -> None:
        """0..max calls (uniform), evenly spaced through the response, log-normal latency."""
        max_calls, median, sigma = self.tool_calls  # type: ignore[misc]
        k = int(self._rng.integers(0, max_calls + 1))
        at = sorted({round(tr.target * (i + 1) / (k + 1)) for i in range(k)} - {0, tr.target})
        tr.tool_at = tuple(at)
        tr.tool_s = tuple(float(x) for x in median * np.exp(sigma * self._rng.standard_normal(len(at))))
