"""The backends half of `laminar bench engine --backend native,vllm`: any engine through the
`RolloutEngine` protocol on one workload, weight loads in place against `load_state_dict`, and
the recorded log-probs against the trainer's recompute.

    python -m laminar.bench.backends --out docs/results/bench-engine-load.json

runs the weight-load comparison alone across model sizes (`LOAD_SHAPES`): vLLM's in-place load
(`VLLMEngine.load_weights`: its worker's `reload_weights`) against a plain `load_state_dict` of
the same tensors, the ratio per size, so the fixed per-layer cost and the per-MB cost show apart.
On vLLM's CPU backend a reload re-packs every linear layer into oneDNN's layout
(`create_onednn_mm`), which a `load_state_dict` never does (docs/engine.md: weight loads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from laminar.engine import Engine
from laminar.engine.protocol import RolloutEngine
from laminar.engine.vllm_engine import VLLMEngine  # imports vllm only when an engine starts
from laminar.models import PAD_ID, build_preset, load_pretrained
from laminar.models.builder import PRESETS, build_shaped
from laminar.provenance import provenance
from laminar.trainer.loss import token_logprobs
from laminar.types import GenerationRequest, SamplingParams

MAX_BATCH_SIZE = 64
# name -> (hidden, layers, attention heads, KV heads), shaped like the presets (models/builder.py)
LOAD_SHAPES = {"tiny": PRESETS["tiny"], "small": PRESETS["small"], "h512x8": (512, 8, 8, 2),
               "h1024x8": (1024, 8, 16, 2)}


def make_requests(workload: list[tuple[list[int], int]]) -> list[GenerationRequest]:
    return [GenerationRequest(f"b{i}", list(prompt),
                              SamplingParams(temperature=1.0, max_new_tokens=num_new))
            for i, (prompt, num_new) in enumerate(workload)]


def run_engine(engine: RolloutEngine, workload) -> dict:
    """Time one engine (any backend) through the workload, through the protocol only."""
    requests = make_requests(workload)
    start, cpu_start = time.perf_counter(), time.process_time()
    for request in requests:
        engine.add(request)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    check_lengths(requests, workload)
    return dict(seconds=seconds, cpu_seconds=cpu_seconds, steps=steps, requests=requests)


def check_lengths(requests: list[GenerationRequest], workload) -> None:
    for request, (_, num_new) in zip(requests, workload):
        if len(request.output_ids) != num_new:
            raise RuntimeError(f"{request.request_id} produced {len(request.output_ids)} tokens, "
                               f"expected {num_new}: the two backends would not do the same work")


def load_s_per_mb(engine: RolloutEngine | torch.nn.Module, named: dict[str, torch.Tensor],
                  repeats: int = 5) -> float:
    """Median seconds per MB of an in-place load of `named` into an engine (`load_weights`,
    a new version each time) or a module (`load_state_dict`, the baseline)."""
    megabytes = sum(t.numel() * t.element_size() for t in named.values()) / 1e6
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if isinstance(engine, torch.nn.Module):
            engine.load_state_dict(named)
        else:
            engine.load_weights(named, engine.version + 1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a copy to the GPU returns before it lands
        times.append(time.perf_counter() - start)
    return statistics.median(times) / megabytes


@torch.no_grad()
def logprob_abs_diff(model, requests: list[GenerationRequest]) -> torch.Tensor:
    """|recorded log-prob - the trainer's recompute| per token (fp32, teacher-forced)."""
    diffs = []
    for r in requests:
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        logits = model(ids).logits[:, len(r.prompt_ids) - 1:-1].float()
        ref = token_logprobs(logits, torch.tensor([r.output_ids]), r.params.temperature)[0]
        diffs.append((ref - torch.tensor(r.logprobs)).abs())
    return torch.cat(diffs)


def bench_vllm(model, preset: str, workload, repeats: int, no_eos: int,
               other: dict[str, torch.Tensor]) -> dict:
    """vLLM's engine on the workload, its weight loads and its log-prob agreement with the
    trainer."""
    start = time.perf_counter()
    engine = VLLMEngine(model, no_eos, PAD_ID, max_batch_size=MAX_BATCH_SIZE)
    start_s = time.perf_counter() - start
    try:
        run_engine(engine, workload[:MAX_BATCH_SIZE])  # warm
        runs = [run_engine(engine, workload) for _ in range(repeats)]
        diffs = logprob_abs_diff(model, runs[-1]["requests"][:64])
        load = load_s_per_mb(engine, other)
    finally:
        engine.close()
    return dict(seconds=statistics.median(r["seconds"] for r in runs), start_s=start_s,
                load_s_per_mb=load, logprob_mean=diffs.mean().item(),
                logprob_p99=torch.quantile(diffs, 0.99).item(), logprob_tokens=len(diffs))


def bench_model(preset: str, seed: int = 0) -> torch.nn.Module:
    """A preset built from config, or a model directory (`--model DIR`, e.g. the GPU check's
    0.5B-shaped one; its vocabulary must hold laminar's char tokens). `seed` != 0 of a
    directory: its weights plus seeded noise (other weights of the same shapes, to load)."""
    if not Path(preset).is_dir():
        return build_preset(preset, seed=seed)
    model, _ = load_pretrained(preset)
    if seed:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-3)
    return model


def bench_backends(model, preset: str, workload, repeats: int, no_eos: int,
                   native_s: float, device: str = "cpu") -> dict:
    """The `backends` table: native and vLLM tokens/s and weight-load times, one workload."""
    total = sum(n for _, n in workload)
    other = {k: v.clone() for k, v in bench_model(preset, seed=1).state_dict().items()}
    native = Engine(bench_model(preset).eval().to(device), no_eos, PAD_ID,
                    max_batch_size=MAX_BATCH_SIZE)
    backends = {"native": dict(tokens_per_s=total / native_s,
                               load_s_per_mb=load_s_per_mb(native, other))}
    baseline = load_s_per_mb(bench_model(preset).to(device), other)
    vllm = bench_vllm(model, preset, workload, repeats, no_eos, other)
    backends["vllm"] = dict(tokens_per_s=total / vllm["seconds"],
                            load_s_per_mb=vllm["load_s_per_mb"], start_s=vllm["start_s"])
    return dict(backends=backends, load_state_dict_s_per_mb=baseline,
                ratio_vllm_vs_native=backends["vllm"]["tokens_per_s"] / (total / native_s),
                logprob_abs_diff_mean_vllm=vllm["logprob_mean"],
                logprob_abs_diff_p99_vllm=vllm["logprob_p99"],
                logprob_tokens_vllm=vllm["logprob_tokens"])


def load_scaling(shapes: dict[str, tuple[int, int, int, int]] = LOAD_SHAPES,
                 repeats: int = 5) -> list[dict]:
    """Per model shape: vLLM's in-place load and `load_state_dict`, ms per MB and their ratio
    (both load the same other weights; one engine per shape, started untimed)."""
    rows = []
    for name, shape in shapes.items():
        model = build_shaped(shape).eval()
        other = {k: v.clone() for k, v in build_shaped(shape, seed=1).state_dict().items()}
        megabytes = sum(t.numel() * t.element_size() for t in other.values()) / 1e6
        engine = VLLMEngine(model, model.config.vocab_size, PAD_ID, max_batch_size=8)
        try:
            vllm = load_s_per_mb(engine, other, repeats)
        finally:
            engine.close()
        plain = load_s_per_mb(build_shaped(shape), other, repeats)
        rows.append(dict(shape=name, megabytes=round(megabytes, 1),
                         vllm_ms_per_mb=vllm * 1e3, load_state_dict_ms_per_mb=plain * 1e3,
                         ratio=vllm / plain))
        print(f"{name:8s} {megabytes:7.1f} MB  vLLM {vllm * 1e3:7.3f} ms/MB  load_state_dict "
              f"{plain * 1e3:7.3f} ms/MB  ratio {vllm / plain:5.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON (with provenance)")
    parser.add_argument("--shapes", default=",".join(LOAD_SHAPES),
                        help=f"comma-separated, of {', '.join(LOAD_SHAPES)}")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in LOAD_SHAPES]
    if unknown:
        parser.error(f"--shapes: '{unknown[0]}' is unknown; choose of {', '.join(LOAD_SHAPES)}")
    torch.set_num_threads(1)
    before = os.getloadavg()[0]
    rows = load_scaling({s: LOAD_SHAPES[s] for s in args.shapes.split(",")}, args.repeats)
    load = [round(before, 2), round(os.getloadavg()[0], 2)]
    print(f"load average (1 min) before/after: {load[0]} / {load[1]} on {os.cpu_count()} CPUs")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            rows=rows, threads=1, repeats=args.repeats, load_average_before_after=load,
            provenance=provenance()), indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
