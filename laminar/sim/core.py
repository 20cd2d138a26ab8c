"""What every simulated schedule shares: the setup of one point, the clock, and the ledger.

Parts:
- `Setup`: one (mode, model, GPUs) point — replicas' decode curve and KV capacity, trainer
  time, weight-movement times, the workload and the batch settings. `paper_setup` builds it
  from the paper's tables; `local.py` builds one for a measured machine.
- `Clock`: a discrete-event queue of callbacks (time, then insertion order: deterministic).
- `Ledger`: what the trainer consumed and when — the paper's throughput metric (prompt +
  response tokens of a global batch / time between consecutive update completions, after
  warm-up), staleness, and the token accounting the conservation test checks.
- `SimResult`: the numbers of one run, JSON-ready.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from laminar.sim import costs, paper
from laminar.sim.calibration import Calibration
from laminar.sim.costs import DecodeCurve, ModelSpec
from laminar.sim.replica import Replica
from laminar.sim.workload import LengthDistribution, Traj, Workload
from laminar.types import GLOBAL_BATCH_MODES

TrainFn = Callable[[float, float, int, int], float]  # (tokens, sum_sq, n_steps, gpus) -> s


@dataclass(slots=True)
class Setup:
    mode: str
    model: str
    gpus: int
    trainer_gpus: int
    rollout_gpus: int
    tp: int
    cal: Calibration
    curve: DecodeCurve
    kv_capacity: int
    prefill_tok_s: float  # seconds per prefill token (linear part)
    prefill_sq_s: float  # seconds per squared context length (attention part)
    train_fn: TrainFn
    sync_s: float  # baselines: global weight sync to every rollout
    push_s: float  # laminar: trainer stall handing weights to the master relay
    broadcast_s: float  # laminar: master relay to the last relay
    pull_s: float  # laminar: rollout loading from its local relay
    controller_s_per_token: float  # verl-based baselines: serial work at the barrier
    update_overhead_s: float  # fixed trainer work per weight update
    lengths: LengthDistribution
    prompts: int = paper.BATCH["prompts"]
    samples: int = paper.BATCH["samples"]
    minibatches: int = paper.BATCH["minibatches_async"]
    max_running: int = paper.BATCH["max_concurrency"]
    seed: int = 0

    @property
    def n_replicas(self) -> int:
        return self.rollout_gpus // self.tp

    @property
    def global_batch(self) -> int:
        return self.prompts * self.samples

    def prefill(self, tokens: float, sum_sq: float) -> float:
        return tokens * self.prefill_tok_s + sum_sq * self.prefill_sq_s

    def make_replicas(self) -> list[Replica]:
        return [Replica(i, self.curve, self.kv_capacity, self.max_running, self.prefill,
                        self.cal.decode_quantum) for i in range(self.n_replicas)]

    def make_workload(self) -> Workload:
        c = self.cal
        tools = (c.tool_calls_max, c.tool_median_s, c.tool_sigma) if c.tool_calls_max else None
        env = (c.env_median_s, c.env_sigma, c.env_max_s) if c.env_median_s > 0 else None
        return Workload(self.lengths, self.samples, c.group_corr, c.prompt_median,
                        c.prompt_sigma, tool_calls=tools, env_latency=env, seed=self.seed)

    def train_time(self, trajs: Iterable[Traj], n_steps: int, gpus: int | None = None,
                   whole_update: bool = True) -> float:
        """Trainer seconds for trajs in n_steps optimizer steps; a whole update also pays the
        fixed per-update work (a mini-batch of a pipelined update does not)."""
        tokens = sq = 0.0
        for tr in trajs:
            n = tr.prompt_len + tr.target
            tokens += n
            sq += n * n
        fixed = self.update_overhead_s if whole_update else 0.0
        return self.train_fn(tokens, sq, n_steps, gpus or self.trainer_gpus) + fixed


def rollout_mem_util(mode: str, cal: Calibration) -> float:
    """gpu_memory_utilization of a mode's rollout engine (its KV budget)."""
    if mode == "sync":
        return cal.colocated_mem_util
    if mode in ("one_step", "stream"):
        return cal.async_baselines_mem_util
    return cal.gpu_mem_util


def paper_setup(mode: str, model: str, gpus: int, cal: Calibration | None = None,
                seed: int = 0) -> Setup:
    """A point of the paper's Fig. 11 grid: Table 2 allocation, App. A.2 TP, §8.1 batch."""
    if mode not in paper.MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(paper.MODES)}")
    cal = cal or Calibration()
    total, trainer, rollout = paper.allocation(mode, model, gpus)
    m: ModelSpec = costs.QWEN25[model]
    tp = paper.rollout_tp(mode, model)
    mfu = cal.partial_trainer_mfu if mode == "partial" else cal.trainer_mfu
    tp_pp = paper.AREAL_TRAIN_TP_PP[model] if mode == "partial" else (1, 1)
    recompute = not (mode == "laminar" and cal.laminar_rollout_logprobs)
    prefill_flops = m.params * 2.0 / (tp * costs.GPU_BF16_FLOPS * cal.prefill_mfu)
    return Setup(
        mode=mode, model=model, gpus=total, trainer_gpus=trainer, rollout_gpus=rollout, tp=tp,
        cal=cal,
        curve=costs.decode_curve(
            m, tp, cal.step_overhead_ms / 1e3,
            (cal.seq_overhead_ms + (cal.tp_seq_overhead_ms if tp > 1 else 0.0)) / 1e3),
        kv_capacity=costs.kv_capacity_tokens(m, tp, rollout_mem_util(mode, cal),
                                             cal.activation_reserve_gb),
        prefill_tok_s=prefill_flops,
        prefill_sq_s=2.0 * m.layers * m.hidden / (tp * costs.GPU_BF16_FLOPS * cal.prefill_mfu),
        train_fn=lambda tok, sq, steps, g: costs.train_s(m, g, tok, sq, steps, mfu, tp_pp,
                                                          cal.megatron_mb_tokens, recompute),
        sync_s=costs.global_sync_s(m, rollout),
        push_s=costs.actor_push_s(m),
        broadcast_s=costs.relay_broadcast_s(m, max(1, rollout // paper.GPUS_PER_MACHINE)),
        pull_s=costs.relay_pull_s(m),
        controller_s_per_token=(cal.controller_us_per_token / 1e6
                                if mode in GLOBAL_BATCH_MODES else 0.0),
        update_overhead_s=(cal.trainer_update_s
                           + cal.trainer_update_s_per_gb * m.weight_bytes / 1e9),
        lengths=LengthDistribution.from_points(paper.FIG17_QUANTILES[model],
                                               max_len=paper.BATCH["max_response"],
                                               q_max=cal.length_max_quantile),
        minibatches=paper.BATCH["minibatches_sync" if mode == "sync" else "minibatches_async"],
        seed=seed)


class Clock:
    """Callbacks ordered by (time, insertion): the same inputs give the same run."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._n = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (t, self._n, fn, args))
        self._n += 1

    def run(self, until: Callable[[], bool]) -> None:
        heap = self._heap
        while heap and not until():
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)


@dataclass(slots=True)
class Ledger:
    """Trainer-side record: one entry per weight update (a consumed global batch)."""

    update_times: list[float] = field(default_factory=list)
    batch_tokens: list[int] = field(default_factory=list)
    staleness: Counter = field(default_factory=Counter)
    trained_tokens: int = 0  # response tokens consumed by the trainer
    discarded_tokens: int = 0  # response tokens thrown away (none in the five schedules)
    mixed_version_trajs: int = 0
    trainer_busy_s: float = 0.0
    repacks: int = 0
    moved_trajs: int = 0

    def consume(self, t_done: float, trajs: list[Traj], trainer_version: int,
                busy_s: float) -> None:
        """The trainer finished updating `trainer_version` -> +1 on trajs at t_done."""
        self.update_times.append(t_done)
        self.batch_tokens.append(sum(tr.prompt_len + tr.target for tr in trajs))
        self.trainer_busy_s += busy_s
        for tr in trajs:
            self.trained_tokens += tr.target
            self.staleness[trainer_version - tr.version] += 1
            self.mixed_version_trajs += tr.versions > 1

    @property
    def num_updates(self) -> int:
        return len(self.update_times)

    def throughput(self, warmup: int) -> float:
        """Tokens per second over updates warmup..end, timed from update warmup-1."""
        n = self.num_updates
        if n <= warmup or warmup < 1:
            raise ValueError(f"need more than {warmup} >= 1 updates, have {n}")
        span = self.update_times[-1] - self.update_times[warmup - 1]
        return sum(self.batch_tokens[warmup:]) / span


@dataclass(slots=True)
class SimResult:
    mode: str
    model: str
    gpus: int
    trainer_gpus: int
    rollout_gpus: int
    tp: int
    replicas: int
    throughput: float  # tokens/s, the paper's metric
    gen_throughput: float  # response tokens decoded per second over the whole run
    iteration_s: float  # mean time between measured updates
    trainer_busy_frac: float
    rollout_busy_frac: float
    staleness: dict[int, int]
    mixed_version_trajs: int
    repacks: int
    moved_trajs: int
    preemptions: int
    tokens: dict[str, int]  # generated = trained + buffered + in_flight + discarded

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def finish_result(setup: Setup, ledger: Ledger, replicas: list[Replica], buffered: list[Traj],
                  warmup: int, end_s: float, held: Iterable[Traj] = ()) -> SimResult:
    """Summarise a run. `buffered`: finished trajectories the trainer has not consumed;
    `held`: unfinished ones the schedule holds off-replica (e.g. during a weight swap)."""
    in_flight = sum(tr.done for tr in held)
    in_flight += sum(tr.done for r in replicas for tr in list(r.waiting) + r.in_tool)
    in_flight += sum(tr.admit_done for r in replicas for tr in r.live())
    generated = sum(r.generated for r in replicas)
    progress = sum(r.in_progress_tokens() for r in replicas)
    n = ledger.num_updates
    measured = max(n - warmup, 1)
    span = ledger.update_times[-1] - ledger.update_times[warmup - 1]
    busy = sum(r.busy_s for r in replicas)
    return SimResult(
        mode=setup.mode, model=setup.model, gpus=setup.gpus, trainer_gpus=setup.trainer_gpus,
        rollout_gpus=setup.rollout_gpus, tp=setup.tp, replicas=setup.n_replicas,
        throughput=ledger.throughput(warmup), iteration_s=span / measured,
        gen_throughput=(generated + progress) / max(end_s, 1e-9),
        trainer_busy_frac=min(1.0, ledger.trainer_busy_s / max(end_s, 1e-9)),
        rollout_busy_frac=min(1.0, busy / max(end_s * len(replicas), 1e-9)),
        staleness=dict(sorted(ledger.staleness.items())),
        mixed_version_trajs=ledger.mixed_version_trajs, repacks=ledger.repacks,
        moved_trajs=ledger.moved_trajs,
        preemptions=sum(r.num_preempted for r in replicas),
        tokens=dict(generated=generated + progress, trained=ledger.trained_tokens,
                    buffered=sum(tr.target for tr in buffered),
                    in_flight=in_flight + progress, discarded=ledger.discarded_tokens))


def mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs) if xs else 0.0
