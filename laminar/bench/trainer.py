"""`laminar bench trainer`: the trainer at world size 1 and 2 on the small preset.

    laminar bench trainer [--quick] [--out bench-trainer.json]

On this machine's cores the comparison is 1 rank x 2 threads against 2 ranks x 1 thread (one
torch process group over gloo, FSDP2 `full`), each a fresh process (`spawn_ranks`), training
the same global batches from the same weights: reverse-task-like trajectories (lengths
log-normal, median 34 tokens, up to ~130), 32 groups x 8 per global batch. Repeats alternate
1, 2, 1, 2, ... so the machine's load (other jobs) falls on both alike; each run records the
load average. Per run:

- throughput: the global batch's prompt + response tokens / the time of `train_step`, after
  one warm-up step (median over steps);
- memory per rank: peak RSS (`ru_maxrss`), and the bytes of the rank's parameters and
  optimizer state (what sharding divides) and gradients, counted tensor by tensor;
- push stall: the trainer's stall publishing the weights to a master relay (a real relay
  process, shared memory) — world size 1 through `Pusher.push` (the one-process path), world
  size 2 from the shards (each rank writes its rows) and, alternating with it, by gathering
  on rank 0;
- the loss of every step, which must match across world sizes (`loss_match_max_abs`).

Both FSDP modes run at two ranks in every repeat (1, `full`, `grad_op`; the one-rank run is
their common baseline) and the full run adds one run of `none` (DDP). Targets (issue 21),
judged for each FSDP mode: parameter + optimizer memory per rank at 2 ranks <= 0.6x of 1 rank,
push stall at 2 ranks <= 1.2x, throughput at 2 ranks >= 0.85x. The top-level keys
(`tokens_per_s_by_world`, `ratios`, `targets_met`, ...) are the default mode's, `full`;
`by_mode_world2` has the same ratios for each FSDP mode.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from laminar.bench.relay_node import RelayProcess
from laminar.config import RelayConfig, TrainerConfig
from laminar.models import build_preset
from laminar.models.tokenizer import PAD_ID
from laminar.provenance import provenance, write_result
from laminar.relay.client import Pusher
from laminar.relay.plan import RelayInfo, build_chain
from laminar.trainer.actor import RelayPush
from laminar.trainer.ranks import follow, spawn_ranks
from laminar.trainer.shards import push_from_shards
from laminar.trainer.trainer import Trainer
from laminar.types import Trajectory

GROUPS, GROUP_SIZE = 32, 8
TARGETS = {"param_optim_mem_ratio_max": 0.6, "push_stall_ratio_max": 1.2, "throughput_ratio_min": 0.85}


def workload(seed: int) -> list[Any]:
    """One global batch: reverse-task-like groups (prompt = BOS + L characters, response = L
    characters + EOS; L log-normal, median 16, clipped to 2..64)."""
    rng = random.Random(seed)
    out = []
    for g in range(GROUPS):
        n = max(2, min(64, round(rng.lognormvariate(2.77, 0.6))))  # e^2.77 = 16
        prompt = [1] + [rng.randrange(4, 100) for _ in range(n)]
        for i in range(GROUP_SIZE):
            response = [rng.randrange(4, 100) for _ in range(n)] + [2]
            out.append(Trajectory(traj_id=f"{seed}.{g}/{i}", group_id=f"{seed}.{g}", prompt_ids=prompt,
                                  response_ids=response, version=0, reward=rng.random(),
                                  logprobs=[-rng.random() * 4 for _ in response]))
    return out


def _memory(trainer: Any) -> dict[str, float]:
    """This rank's peak RSS and the bytes it holds of parameters, optimizer state, gradients."""
    def local(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(trainer.model.parameters())
    optim = sum(local(v) for state in trainer.optimizer.state.values() for v in state.values()
                if hasattr(v, "numel"))
    mb = 1 << 20
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "param_mb": sum(local(p) for p in params) / mb, "optim_mb": optim / mb,
            "grad_mb": sum(local(p.grad) for p in params if p.grad is not None) / mb}


def _run(ranks: Any, sharding: str, steps: int, pushes: int, first_version: int,
         relay: dict[str, Any], secret: bytes, relay_cfg: Any) -> dict[str, Any] | None:
    """One world size, every rank: build the small preset, train `steps` + 1 global batches,
    push `pushes` times (each way at two ranks); rank 0 returns the measurements."""
    import torch

    torch.manual_seed(0)
    trainer = Trainer(build_preset("small", seed=0), TrainerConfig(lr=1e-4, sharding=sharding),
                      pad_token_id=PAD_ID, ranks=ranks)
    if ranks is not None and not ranks.is_leader:
        return follow(trainer, ranks)
    losses, times, tokens = [], [], []
    for seed in range(steps + 1):
        batch = workload(seed)
        t0 = time.perf_counter()
        stats = trainer.train_step(batch)
        if seed:  # the first is warm-up
            times.append(time.perf_counter() - t0)
            tokens.append(sum(t.num_tokens for t in batch))
        losses.append(stats["loss"])
    memory = ([_memory(trainer)] if ranks is None else
              ranks.call_all(trainer, _memory))
    sink = RelayPush(Pusher(build_chain([RelayInfo(**relay)]), secret, relay_cfg))
    stalls: dict[str, list[float]] = {}
    version = first_version
    for _ in range(pushes):
        for method in (["one_process"] if ranks is None else ["shards", "gather"]):
            version += 1
            stall = (trainer.push(sink, version, relay_cfg.chunk_bytes) if ranks is None else
                     push_from_shards(trainer, sink, version, relay_cfg.chunk_bytes, method))
            stalls.setdefault(method, []).append(stall)
    sink.pusher.close()
    return {"step_s": times, "tokens": tokens, "losses": losses, "memory": memory, "stalls": stalls}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main(quick: bool = False, out: str | None = None) -> dict[str, Any]:
    from dataclasses import asdict

    cores = os.cpu_count() or 1
    steps, repeats, pushes = (3, 1, 5) if quick else (8, 3, 40)
    relay_cfg = RelayConfig()
    secret = uuid.uuid4().hex.encode()
    plan = [run for _ in range(repeats) for run in ((1, "full"), (2, "full"), (2, "grad_op"))]
    if not quick:
        plan += [(2, "none")]
    print(f"bench trainer: small preset, {GROUPS}x{GROUP_SIZE} trajectories per global batch, "
          f"{steps} measured steps per run, runs {plan}, {cores} cores")
    runs = []
    with tempfile.TemporaryDirectory(prefix="laminar-bench-trainer-") as tmp:
        relay = RelayProcess("r0", f"bt{uuid.uuid4().hex[:6]}", secret, relay_cfg,
                             log_path=Path(tmp) / "relay.log")
        try:
            for k, (world, sharding) in enumerate(plan):
                load_before = os.getloadavg()
                t0 = time.perf_counter()
                r = spawn_ranks(world, _run, sharding, steps, pushes, 1000 * k, asdict(relay.info),
                                secret, relay_cfg, threads=max(1, cores // world))
                r.update(world=world, sharding=sharding, threads=max(1, cores // world),
                         wall_s=time.perf_counter() - t0, loadavg_before=list(load_before),
                         loadavg_after=list(os.getloadavg()))
                r["tokens_per_s"] = _median([n / s for n, s in zip(r["tokens"], r["step_s"])])
                runs.append(r)
                print(f"  world {world} {sharding:7s} x{r['threads']} threads: "
                      f"{r['tokens_per_s']:,.0f} tokens/s, param+optim "
                      f"{[round(m['param_mb'] + m['optim_mb'], 1) for m in r['memory']]} MB/rank, "
                      f"peak RSS {[round(m['peak_rss_mb']) for m in r['memory']]} MB/rank, stall "
                      + ", ".join(f"{m} {_median(v) * 1e3:.1f} ms" for m, v in r["stalls"].items())
                      + f" (load {load_before[0]:.1f} -> {r['loadavg_after'][0]:.1f})", flush=True)
        finally:
            relay.close()
    result = summarize(runs, cores, quick)
    result["provenance"] = provenance({"steps": steps, "repeats": repeats, "pushes": pushes,
                                       "groups": GROUPS, "group_size": GROUP_SIZE,
                                       "chunk_bytes": relay_cfg.chunk_bytes})
    _print(result)
    write_result(out, result)
    return result


def summarize(runs: list[dict[str, Any]], cores: int, quick: bool) -> dict[str, Any]:
    """Medians per world size, ratios 2 vs 1 and the targets: for the default `full` at the
    top level, and for each FSDP mode in `by_mode_world2`."""
    one = [r for r in runs if r["world"] == 1]

    def per_rank(rs: list[dict[str, Any]], key: Any) -> list[float]:  # median over runs, per rank
        return [_median([key(r["memory"][k]) for r in rs]) for k in range(rs[0]["world"])]

    def pm(rs: list[dict[str, Any]]) -> list[float]:
        return per_rank(rs, lambda m: m["param_mb"] + m["optim_mb"])

    def stalls(rs: list[dict[str, Any]]) -> list[float]:
        return [s for r in rs for s in r["stalls"]["one_process" if r["world"] == 1 else "shards"]]

    def mode(sharding: str) -> dict[str, Any]:
        two = [r for r in runs if r["world"] == 2 and r["sharding"] == sharding]
        tps = {1: [r["tokens_per_s"] for r in one], 2: [r["tokens_per_s"] for r in two]}
        ratios = {"throughput_2_vs_1": _median(tps[2]) / _median(tps[1]),
                  "param_optim_mem_2_vs_1": max(pm(two)) / pm(one)[0],
                  "push_stall_2_vs_1": _median(stalls(two)) / _median(stalls(one))}
        return {"tokens_per_s_2": _median(tps[2]), "tokens_per_s_range_2": [min(tps[2]), max(tps[2])],
                "param_optim_mb_per_rank_2": pm(two), "push_stall_s_2": _median(stalls(two)),
                "ratios": ratios, "targets_met": _targets_met(ratios)}

    full = [r for r in runs if r["world"] == 2 and r["sharding"] == "full"]
    gather = [s for r in full for s in r["stalls"]["gather"]]
    tps1 = [r["tokens_per_s"] for r in one]
    default = mode("full")
    ratios = {**default["ratios"],
              "push_stall_gather_vs_shards_2": _median(gather) / default["push_stall_s_2"]}
    losses = [r["losses"] for r in one]
    match = max(abs(a - b) for r in runs if r["world"] == 2 for ref in losses
                for a, b in zip(r["losses"], ref))
    return {
        "quick": quick,
        "cores": cores,
        "tokens_per_s_by_world": {"1": _median(tps1), "2": default["tokens_per_s_2"]},
        "tokens_per_s_range_by_world": {"1": [min(tps1), max(tps1)], "2": default["tokens_per_s_range_2"]},
        "peak_mem_mb_per_rank_by_world": {"1": per_rank(one, lambda m: m["peak_rss_mb"]),
                                          "2": per_rank(full, lambda m: m["peak_rss_mb"])},
        "param_optim_mb_per_rank_by_world": {"1": pm(one), "2": pm(full)},
        "grad_mb_per_rank_by_world": {"1": per_rank(one, lambda m: m["grad_mb"]),
                                      "2": per_rank(full, lambda m: m["grad_mb"])},
        "push_stall_s_by_world": {"1": _median(stalls(one)), "2": default["push_stall_s_2"]},
        "push_stall_s_range_by_world": {"1": [min(stalls(one)), max(stalls(one))],
                                        "2": [min(stalls(full)), max(stalls(full))]},
        "push_stall_s_gather_world2": _median(gather),
        "loss_match_max_abs": match,
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": default["targets_met"],
        "by_mode_world2": {m: mode(m) for m in ("full", "grad_op")},
        "by_sharding_world2": {r["sharding"]: {
            "tokens_per_s": r["tokens_per_s"],
            "param_optim_mb_per_rank": [m["param_mb"] + m["optim_mb"] for m in r["memory"]],
            "peak_mem_mb_per_rank": [m["peak_rss_mb"] for m in r["memory"]],
            "push_stall_s": _median(r["stalls"]["shards"])}
            for r in runs if r["world"] == 2 and r["sharding"] == "none"},  # DDP: one run
        "runs": runs,
    }


def _targets_met(ratios: dict[str, float]) -> dict[str, bool]:
    return {"param_optim_mem": ratios["param_optim_mem_2_vs_1"] <= TARGETS["param_optim_mem_ratio_max"],
            "push_stall": ratios["push_stall_2_vs_1"] <= TARGETS["push_stall_ratio_max"],
            "throughput": ratios["throughput_2_vs_1"] >= TARGETS["throughput_ratio_min"]}


def _print(r: dict[str, Any]) -> None:
    ratios, met = r["ratios"], r["targets_met"]
    print(f"tokens/s: 1 rank {r['tokens_per_s_by_world']['1']:,.0f}, 2 ranks "
          f"{r['tokens_per_s_by_world']['2']:,.0f} -> {ratios['throughput_2_vs_1']:.2f}x "
          f"(target >= 0.85: {'met' if met['throughput'] else 'MISSED'})")
    print(f"param+optimizer MB per rank: {r['param_optim_mb_per_rank_by_world']} -> "
          f"{ratios['param_optim_mem_2_vs_1']:.2f}x (target <= 0.6: "
          f"{'met' if met['param_optim_mem'] else 'MISSED'}); peak RSS MB per rank "
          f"{r['peak_mem_mb_per_rank_by_world']}")
    print(f"push stall: 1 rank {r['push_stall_s_by_world']['1'] * 1e3:.1f} ms, 2 ranks from shards "
          f"{r['push_stall_s_by_world']['2'] * 1e3:.1f} ms -> {ratios['push_stall_2_vs_1']:.2f}x "
          f"(target <= 1.2: {'met' if met['push_stall'] else 'MISSED'}); gathering on rank 0 "
          f"{r['push_stall_s_gather_world2'] * 1e3:.1f} ms")
    print(f"loss, 2 ranks vs 1, max |difference| over steps: {r['loss_match_max_abs']:.2e}")
    for name, m in r["by_mode_world2"].items():
        q, ok = m["ratios"], m["targets_met"]
        print(f"  {name:7s} at 2 ranks: tokens/s {q['throughput_2_vs_1']:.2f}x, param+optimizer "
              f"{q['param_optim_mem_2_vs_1']:.2f}x, push stall {q['push_stall_2_vs_1']:.2f}x: "
              + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in ok.items()))
