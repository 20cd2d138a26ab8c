"""`laminar bench engine --spec`: the native engine's shared group prefixes and speculative
decoding, each against the same engine without it, in one run.

    laminar bench engine --spec [--quick] [--device cpu|cuda] [--out FILE]

Speculation (`rollout.engine.speculation`): the model is `laminar bench modes`' warm start (the
tiny preset after its SFT, cached under `sft.cache_dir`; trained here once if missing), on the
modes workload's prompts: reverse-task prompts, groups of 8 samples (temperature and budget of
that workload, the real EOS), `--groups` groups submitted at once to an engine of the
workload's batch and KV sizes, for two epochs on the same engine (the second epoch's prompts
are the first's: a prompt comes back epoch after epoch; new seeds). The variants run the
identical requests (same seeds, so the same tokens: checked) with speculation off and on,
alternating, `repeats` times; medians compared.
- `speculation_gain`: generated tokens/s with / without, over both epochs; per epoch beside
  (`speculation_gain_by_epoch`);
- `speculation_tail_speedup`: the time from the moment 95% of an epoch's requests finished to
  its last finish (the slowest 5%), without / with, the median over epochs and repeats; in
  CPU time beside (`speculation_tail_speedup_cpu`), as `speculation_gain_cpu` is beside the
  wall-clock gain: the wall clock of a shared machine is noisy at these durations;
- `acceptance_rate`: accepted / drafted tokens, with `drafted_per_step`, `accepted_per_step`,
  and [drafted, accepted] by the step's decode rows (`drafted_accepted_by_rows`);
- `fixed_rule_*`: the same requests under the earlier fixed drafting rule
  (`Engine.speculation_min_drafts = 1`: drafts while the batch is at most half of
  `speculation_tokens`, verified when at least one per row), a third arm of each repeat;
- `verify_cost_ms`: the cost of a verification forward vs batch and draft length, on the same
  model (the CPU side of the trade), with `plain_cost_ms` beside it: a plain decode forward of
  the same number of tokens (rows x (1 + draft) rows), CPU ms;
- `acceptance_bound`: the mean, over the tokens the plain engine generated, of the target's
  largest token probability at that position (teacher-forced): no deterministic drafter's
  acceptance rate under the lossless rule can exceed it on these tokens (a draft d is accepted
  with probability p(d) <= max p); `acceptance_bound_tail` the same over the tokens generated
  after 95% of an epoch's requests had finished (none with `--quick`: its last 5% finish in
  one step);
- `speculation_gain_ceiling`: the gain the plain run's steps would allow if every row drafted
  k tokens for free, each accepted with probability `acceptance_bound` (`gain_ceiling`);
  `speculation_gain_ceiling_small` the same over its steps of at most 8 rows at
  `acceptance_bound_tail`.
The speculating engine decides its drafts on the tiny preset's measured decode curve (knee.py's
cache, measured now if missing: `step_cost_ms`).

Shared prefixes (no EOS: every request generates its drawn length, so the variants do the
same work on a random-init tiny model):
- `prefix_prefill_ratio`: prefill tokens computed per group of 8, shared / unshared, on the
  reverse workload;
- `prefix_long_prompt_gain`: tokens/s shared / unshared on prompts of 256 tokens with 48-token
  responses (prompts >= 4x responses), groups of 8.

One torch thread, as `laminar bench engine`. The machine is shared: ratios, not times.
`--device cuda` runs every variant on the GPU (the warm start is trained, or read from the
cache, on the CPU first): there a step's cost stays flat much longer, the regime speculation
is for, so the cost rule drafts by the GPU's own curve, measured in wall time (knee.py,
`step_clock`); `verify_cost_ms` / `plain_cost_ms` are then wall ms with the device
synchronized, and the `_cpu` ratios are the host process's CPU time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from laminar.config import load_config
from laminar.engine import Engine
from laminar.devices import resolve_device
from laminar.engine.knee import cached_knee, device_name, step_clock
from laminar.engine.speculation import StepCost, plan_drafts
from laminar.models import BOS_ID, EOS_ID, PAD_ID, build_preset, load_pretrained
from laminar.models.tokenizer import build_char_tokenizer, encode_prompt
from laminar.provenance import provenance
from laminar.tasks import build_task
from laminar.types import GenerationRequest, SamplingParams

THREADS = 1
GROUP_SIZE = 8
SPECULATION = 4  # the drafted tokens per sequence and step measured


def warm_start(device: str = "cpu"):
    """The modes benchmark's warm-started model (cached SFT) on `device`, and its config."""
    from laminar.bench.modes import WORKLOAD  # the one place its settings live
    from laminar.trainer.sft import run_sft

    cfg = load_config(None, WORKLOAD)
    model, _ = load_pretrained(run_sft(cfg))
    return model.eval().to(device), cfg


def reverse_prompts(cfg, num_groups: int) -> list[list[int]]:
    tokenizer = build_char_tokenizer()
    items = build_task(cfg.task).train[:num_groups]
    return [encode_prompt(tokenizer, item.prompt) for item in items]


def run_epochs(model, prompts: list[list[int]], params: SamplingParams, engine_kw: dict,
               epochs: int, min_drafts: float | None = None) -> dict:
    """Both epochs on one engine: per epoch, seconds, tokens, tail seconds; the outputs; the
    rows of every step and the drafts by batch size. `min_drafts`: the fixed drafting rule
    (Engine.speculation_min_drafts) instead of the cost rule."""
    engine = Engine(model, EOS_ID, PAD_ID, **engine_kw)
    engine.speculation_min_drafts = min_drafts
    out = dict(seconds=[], cpu_seconds=[], tokens=[], tail_s=[], tail_cpu_s=[], outputs=[],
               tail_from=[], step_rows=[], drafts_by_rows={})
    for epoch in range(epochs):
        reqs = [GenerationRequest(f"e{epoch}g{j}s{i}", list(p),
                                  dataclasses.replace(params, seed=epoch * 10**6 + j * 100 + i))
                for j, p in enumerate(prompts) for i in range(GROUP_SIZE)]
        for req in reqs:
            engine.add(req)
        finished, start, cpu_start = [], time.perf_counter(), time.process_time()
        tail_from = None  # output length of each request when 95% of them had finished
        while engine.has_unfinished():
            drafted, accepted = engine.num_drafted_tokens, engine.num_accepted_tokens
            deltas = engine.step()
            rows = len(engine.scheduler.running) + sum(d.finish_reason is not None
                                                       for d in deltas)  # the rows that decoded
            out["step_rows"].append(rows)
            if engine.num_drafted_tokens > drafted:
                size = "1-8" if rows <= 8 else "9-32" if rows <= 32 else "33+"
                tally = out["drafts_by_rows"].setdefault(size, [0, 0])
                tally[0] += engine.num_drafted_tokens - drafted
                tally[1] += engine.num_accepted_tokens - accepted
            for delta in deltas:
                if delta.finish_reason is not None:
                    finished.append((time.perf_counter() - start,
                                     time.process_time() - cpu_start))
            if tail_from is None and len(finished) >= int(0.95 * len(reqs)):
                tail_from = [len(r.output_ids) if r.finish_reason is None else None for r in reqs]
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        out["cpu_seconds"].append(cpu_seconds)
        finished.sort()
        out["seconds"].append(seconds)
        out["tokens"].append(sum(len(r.output_ids) for r in reqs))
        at_95 = finished[int(0.95 * len(finished)) - 1]
        out["tail_s"].append(seconds - at_95[0])
        out["tail_cpu_s"].append(cpu_seconds - at_95[1])
        out["outputs"].append([r.output_ids for r in reqs])
        out["tail_from"].append(tail_from)
    out.update(drafted=engine.num_drafted_tokens, accepted=engine.num_accepted_tokens,
               spec_steps=engine.num_spec_steps, prefill_tokens=engine.num_prefill_tokens)
    return out


def bench_speculation(num_groups: int, repeats: int, device: str = "cpu") -> dict:
    model, cfg = warm_start(device)
    prompts = reverse_prompts(cfg, num_groups)
    r = cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            max_new_tokens=r.max_new_tokens)
    kw = dict(max_batch_size=r.engine.max_batch_size, kv_capacity_tokens=r.engine.kv_capacity_tokens)
    knee = cached_knee("tiny", None, THREADS, device=device)
    curve = {int(b): ms for b, ms in knee["curve_ms"].items()}
    spec_kw = {**kw, "speculation": SPECULATION, "step_cost_ms": curve}
    run_epochs(model, prompts[:2], params, kw, 1)  # warm
    plain_runs, spec_runs, fixed_runs = [], [], []
    for _ in range(repeats):
        plain_runs.append(run_epochs(model, prompts, params, kw, 2))
        spec_runs.append(run_epochs(model, prompts, params, spec_kw, 2))
        fixed_runs.append(run_epochs(model, prompts, params, spec_kw, 2, min_drafts=1.0))
    for p, s, f in zip(plain_runs, spec_runs, fixed_runs):
        if not p["outputs"] == s["outputs"] == f["outputs"]:
            raise AssertionError("speculation changed the sampled tokens")
    tokens = sum(plain_runs[0]["tokens"])

    def median(runs, key, epoch=None):
        return statistics.median(sum(x[key]) if epoch is None else x[key][epoch] for x in runs)

    gain = median(plain_runs, "seconds") / median(spec_runs, "seconds")
    by_epoch = [median(plain_runs, "seconds", e) / median(spec_runs, "seconds", e) for e in (0, 1)]
    tails = [p["tail_s"][e] / s["tail_s"][e] for p, s in zip(plain_runs, spec_runs) for e in (0, 1)]
    tails_cpu = [p["tail_cpu_s"][e] / s["tail_cpu_s"][e]
                 for p, s in zip(plain_runs, spec_runs) for e in (0, 1)]
    tails_fixed_cpu = [p["tail_cpu_s"][e] / f["tail_cpu_s"][e]
                       for p, f in zip(plain_runs, fixed_runs) for e in (0, 1)]
    s0, f0 = spec_runs[0], fixed_runs[0]
    lengths = sorted(len(o) for o in plain_runs[0]["outputs"][0])
    bound, bound_tail = acceptance_bound(model, prompts, plain_runs[0])
    cost = StepCost(curve)
    rows = plain_runs[0]["step_rows"]
    tail_rows = [n for n in rows if n <= 8]
    tail_p = bound_tail if bound_tail is not None else bound
    return dict(
        num_groups=num_groups, group_size=GROUP_SIZE, speculation=SPECULATION, repeats=repeats,
        max_batch_size=kw["max_batch_size"], kv_capacity_tokens=kw["kv_capacity_tokens"],
        temperature=params.temperature, max_new_tokens=params.max_new_tokens,
        generated_tokens=tokens,
        response_len_p50=lengths[len(lengths) // 2], response_len_max=lengths[-1],
        plain_tokens_per_s=tokens / median(plain_runs, "seconds"),
        spec_tokens_per_s=tokens / median(spec_runs, "seconds"),
        speculation_gain=gain, speculation_gain_by_epoch=by_epoch,
        speculation_gain_cpu=median(plain_runs, "cpu_seconds") / median(spec_runs, "cpu_seconds"),
        speculation_tail_speedup=statistics.median(tails),
        speculation_tail_speedup_cpu=statistics.median(tails_cpu),
        tail_s_plain_by_epoch=[median(plain_runs, "tail_s", e) for e in (0, 1)],
        tail_s_spec_by_epoch=[median(spec_runs, "tail_s", e) for e in (0, 1)],
        acceptance_rate=s0["accepted"] / max(s0["drafted"], 1),
        drafted_per_step=s0["drafted"] / max(s0["spec_steps"], 1),
        accepted_per_step=s0["accepted"] / max(s0["spec_steps"], 1),
        drafted_accepted_by_rows=s0["drafts_by_rows"],
        # the earlier fixed rule (drafts while the batch is <= 32 rows, verified when at least
        # one per row) on the same requests, for comparison
        fixed_rule_gain=median(plain_runs, "seconds") / median(fixed_runs, "seconds"),
        fixed_rule_gain_cpu=(median(plain_runs, "cpu_seconds")
                             / median(fixed_runs, "cpu_seconds")),
        fixed_rule_tail_speedup_cpu=statistics.median(tails_fixed_cpu),
        # the spread: each repeat's CPU-time ratio, plain / speculating (cost rule; fixed rule)
        speculation_gain_cpu_by_repeat=[sum(p["cpu_seconds"]) / sum(s["cpu_seconds"])
                                        for p, s in zip(plain_runs, spec_runs)],
        fixed_rule_gain_cpu_by_repeat=[sum(p["cpu_seconds"]) / sum(f["cpu_seconds"])
                                       for p, f in zip(plain_runs, fixed_runs)],
        fixed_rule_acceptance_rate=f0["accepted"] / max(f0["drafted"], 1),
        fixed_rule_drafted_accepted_by_rows=f0["drafts_by_rows"],
        acceptance_bound=bound, acceptance_bound_tail=bound_tail, step_cost_ms=curve,
        plain_steps=len(rows), plain_steps_full=sum(n == kw["max_batch_size"] for n in rows),
        speculation_gain_ceiling=gain_ceiling(rows, bound, SPECULATION, cost),
        speculation_gain_ceiling_small=gain_ceiling(tail_rows, tail_p, SPECULATION, cost),
        **verify_cost(model))


@torch.inference_mode()
def acceptance_bound(model, prompts: list[list[int]], run: dict) -> tuple[float, float]:
    """Mean largest token probability of the target at each generated token of `run` (all
    epochs), and the same over the tokens generated after 95% of an epoch's requests had
    finished (sampling at temperature 1, no top-k / top-p: the modes workload's)."""
    values, tail = [], []
    for outputs, tail_from in zip(run["outputs"], run["tail_from"]):
        for i, (out, late) in enumerate(zip(outputs, tail_from)):
            prompt = prompts[i // GROUP_SIZE]
            ids = torch.tensor([prompt + out], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1:-1]
            best = logits.float().softmax(-1).max(-1).values.tolist()
            values += best
            if late is not None:
                tail += best[late:]
    return statistics.fmean(values), statistics.fmean(tail) if tail else None  # None: no tail


def gain_ceiling(step_rows: list[int], p: float, k: int, cost: StepCost) -> float:
    """Throughput gain speculation could reach on the plain run's steps (rows per step) if
    every row drafted k tokens for free, each accepted with probability p given the ones
    before, the step taking the drafts that pay (plan_drafts): the sum of the plain steps'
    costs / the sum of their costs divided by each step's best expected tokens-per-cost
    ratio. An optimistic ceiling for the CPU side, not a prediction."""
    step_rows = [n for n in step_rows if n > 0]
    plain = sum(cost(n) for n in step_rows)
    spec = 0.0
    for n in step_rows:
        lengths = plan_drafts(n, [(k, p)] * n, cost)
        m = sum(lengths)
        expected = n + n * sum(p ** i for i in range(1, 1 + max(lengths)))
        spec += cost(n) / ((expected / cost(n + m)) / (n / cost(n))) if m else cost(n)
    return plain / spec if spec else 1.0


def verify_cost(model, batches=(1, 8, 32, 64), drafts=(0, 2, 4), steps: int = 12,
                rounds: int = 3) -> dict:
    """ms of one verify forward with `batch` rows of 1 + draft tokens each, and of one plain
    decode forward of as many rows (CPU time; on a GPU wall time, synchronized): the median of
    `steps` calls, the lowest of `rounds` rounds (the two alternate)."""
    runners, verify, plain = {}, {}, {}
    clock = step_clock(model.device)
    for batch in batches:
        for k in drafts:
            for rows in (batch, batch * (k + 1)):
                if rows not in runners:
                    engine = Engine(model, 10**6, PAD_ID, max_batch_size=rows)
                    params = SamplingParams(temperature=1.0, max_new_tokens=64)
                    for i in range(rows):
                        engine.add(GenerationRequest(
                            f"v{i}", [BOS_ID] + [10 + (i + j) % 60 for j in range(20)], params))
                    for _ in range(4):
                        engine.step()
                    runners[rows] = (engine.runner,
                                     [seq.num_tokens - 1 for seq in engine.scheduler.running])
    for _ in range(rounds):
        for batch in batches:
            runner, starts = runners[batch]
            for k in drafts:
                key = f"b{batch}_k{k}"
                feeds = [[11] * (k + 1) for _ in range(batch)]
                verify[key] = min(verify.get(key, 1e9),
                                  _median_ms(lambda: runner.verify(feeds, starts), steps, clock))
                wide, wide_starts = runners[batch * (k + 1)]
                tokens = [11] * (batch * (k + 1))
                plain[key] = min(plain.get(key, 1e9),
                                 _median_ms(lambda: wide.run(tokens, wide_starts, []), steps, clock))
    return dict(verify_cost_ms=verify, plain_cost_ms=plain)


def _median_ms(fn, steps: int, clock=time.process_time) -> float:
    times = []
    for _ in range(steps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return 1000 * statistics.median(times)


def group_workload(prompt_len: int, num_new: int, num_groups: int, seed: int = 0
                   ) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([BOS_ID] + [rng.randrange(4, 100) for _ in range(prompt_len - 1)], num_new)
            for _ in range(num_groups)]


def run_groups(model, groups: list[tuple[list[int], int]], share: bool, max_batch: int) -> dict:
    engine = Engine(model, 10**6, PAD_ID, max_batch_size=max_batch, share_prefixes=share)
    reqs = [GenerationRequest(f"g{j}s{i}", list(p), SamplingParams(max_new_tokens=n, seed=i))
            for j, (p, n) in enumerate(groups) for i in range(GROUP_SIZE)]
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.generate(reqs)
    return dict(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start,
                prefill_tokens=engine.num_prefill_tokens,
                tokens=sum(len(r.output_ids) for r in reqs))


def bench_prefix(num_groups: int, repeats: int, device: str = "cpu") -> dict:
    model = build_preset("tiny", seed=0).eval().to(device)
    cfg = load_config(None, [])
    reverse = [(p, 16) for p in reverse_prompts(cfg, num_groups)]
    shared = run_groups(model, reverse, True, 64)
    plain = run_groups(model, reverse, False, 64)
    long = group_workload(256, 48, num_groups)
    run_groups(model, long[:2], True, 64)  # warm
    runs = {True: [], False: []}
    for _ in range(repeats):
        for share in (False, True):
            runs[share].append(run_groups(model, long, share, 64))
    return dict(
        prefix_prefill_ratio=shared["prefill_tokens"] / plain["prefill_tokens"],
        prefill_tokens_per_group_shared=shared["prefill_tokens"] / num_groups,
        prefill_tokens_per_group_unshared=plain["prefill_tokens"] / num_groups,
        prefix_long_prompt_gain=median_ratio(runs, "seconds"),
        prefix_long_prompt_gain_cpu=median_ratio(runs, "cpu_seconds"),
        long_prompt_tokens=256, long_response_tokens=48)


def median_ratio(runs: dict, key: str) -> float:
    return (statistics.median(r[key] for r in runs[False])
            / statistics.median(r[key] for r in runs[True]))


def main(quick: bool = False, out: str | None = None, device: str = "cpu") -> dict:
    device = str(resolve_device(device, "--device"))  # a missing GPU: one clear error, first
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    sizes = dict(num_groups=16, repeats=1) if quick else dict(num_groups=64, repeats=5)
    try:
        result = {**bench_speculation(**sizes, device=device), **bench_prefix(**sizes, device=device)}
    finally:
        torch.set_num_threads(threads)
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result.update(threads=THREADS, load_average_before_after=load, device=device,
                  device_name=device_name(device),
                  targets={"speculation_gain": 1.5, "speculation_tail_speedup": 1.5,
                           "prefix_prefill_ratio_max": 1 / 6, "prefix_long_prompt_gain": 1.3},
                  provenance=provenance({"quick": quick, **sizes, "threads": THREADS,
                                         "speculation": SPECULATION, "device": device}))
    print_report(result)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    return result


def print_report(r: dict) -> None:
    print(f"on {r['device']} ({r['device_name']}): "
          f"speculation (k={r['speculation']}), {r['num_groups']} groups x {r['group_size']}, "
          f"2 epochs, {r['generated_tokens']} tokens: gain {r['speculation_gain']:.2f}x "
          f"(by epoch {', '.join(f'{g:.2f}x' for g in r['speculation_gain_by_epoch'])}), tail "
          f"speedup {r['speculation_tail_speedup']:.2f}x (CPU time: gain "
          f"{r['speculation_gain_cpu']:.2f}x, tail {r['speculation_tail_speedup_cpu']:.2f}x), acceptance {r['acceptance_rate']:.2f}, "
          f"drafted/accepted per step {r['drafted_per_step']:.1f}/{r['accepted_per_step']:.1f}")
    print("CPU-time gain by repeat: cost rule "
          + ", ".join(f"{g:.2f}x" for g in r["speculation_gain_cpu_by_repeat"]) + "; fixed rule "
          + ", ".join(f"{g:.2f}x" for g in r["fixed_rule_gain_cpu_by_repeat"]))
    print(f"drafted/accepted by decode rows: {r['drafted_accepted_by_rows']}; the fixed rule: "
          f"gain {r['fixed_rule_gain']:.2f}x (CPU time {r['fixed_rule_gain_cpu']:.2f}x, tail "
          f"{r['fixed_rule_tail_speedup_cpu']:.2f}x), acceptance "
          f"{r['fixed_rule_acceptance_rate']:.2f}, by rows "
          f"{r['fixed_rule_drafted_accepted_by_rows']}")
    print("verify forward CPU ms (batch, draft) / plain forward of as many tokens:",
          ", ".join(f"{k} {v:.2f}/{r['plain_cost_ms'][k]:.2f}"
                    for k, v in r["verify_cost_ms"].items()))
    tail = r["acceptance_bound_tail"]
    print(f"acceptance bound (mean max token probability): {r['acceptance_bound']:.2f}, in the "
          f"tail {'-' if tail is None else f'{tail:.2f}'}; gain ceiling at that acceptance, free "
          f"drafts: {r['speculation_gain_ceiling']:.2f}x (steps of <= 8 rows: "
          f"{r['speculation_gain_ceiling_small']:.2f}x); plain steps {r['plain_steps']}, "
          f"{r['plain_steps_full']} of them full")
    print(f"shared prefixes: prefill ratio {r['prefix_prefill_ratio']:.3f} (target <= 0.167), "
          f"long-prompt gain {r['prefix_long_prompt_gain']:.2f}x (CPU time "
          f"{r['prefix_long_prompt_gain_cpu']:.2f}x; target 1.3x)")
    print(f"load average (1 min) before/after: {r['load_average_before_after']}")
