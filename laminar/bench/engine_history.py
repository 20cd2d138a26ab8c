"""`python -m laminar.bench.engine_history --history REV... | --profile`: the native engine's tokens/s
across git revisions of laminar (each revision's own code, in a subprocess), and where one
native run spends its CPU time (torch profiler)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from laminar.bench.backends import MAX_BATCH_SIZE
from laminar.bench.engine import THREADS, build_workload, run_native
from laminar.models import build_preset


# -- history: what each commit of the engine bought -------------------------------------------
#
#   python -m laminar.bench.engine_history --history 8c44aa7 HEAD --preset small
#
# Each revision's `laminar/` is exported with `git archive` and timed in its own subprocess on
# the same workload (best of 3 runs inside the process; 1 for the slow static backend),
# revisions alternating `repeats` times and the medians compared: the machine is shared, only
# comparisons inside one run mean anything. The snippet uses only APIs every revision has.

_HISTORY_SNIPPET = r"""
import sys, time, torch
torch.set_num_threads(1)
from laminar.config import ReverseTaskConfig
from laminar.engine import Engine, HFEngine
from laminar.engine import knee as engine_knee
from laminar.models import PAD_ID, build_char_tokenizer, build_preset, encode_prompt
from laminar.tasks.reverse import make_prompts
from laminar.types import GenerationRequest, SamplingParams
backend, preset, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = build_char_tokenizer()
work = [(encode_prompt(tok, it.prompt), len(it.answer) + 1)
        for it in make_prompts(ReverseTaskConfig(), n, 0)]
model = build_preset(preset)
cls = Engine if backend == "native" else HFEngine
def run(work):
    reqs = [GenerationRequest(f"b{i}", list(p), SamplingParams(temperature=1.0, max_new_tokens=k))
            for i, (p, k) in enumerate(work)]
    engine = cls(model, model.config.vocab_size, PAD_ID, max_batch_size=64)
    start, cpu = time.perf_counter(), time.process_time()
    engine.generate(reqs)
    assert [len(r.output_ids) for r in reqs] == [k for _, k in work]
    return time.perf_counter() - start, time.process_time() - cpu
run(work[:64])
times = [run(work) for _ in range(int(sys.argv[4]))]
print(sum(k for _, k in work), min(t[0] for t in times), min(t[1] for t in times))
"""


def history(revisions: list[str], preset: str, num_requests: int, repeats: int) -> list[dict]:
    """Native tokens/s of each git revision of laminar (plus the static backend of the last)."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="laminar-history-") as tmp:
        trees = {}
        for rev in revisions:
            tree = Path(tmp) / rev.replace("/", "_")
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(root), "archive", rev, "laminar"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
            trees[rev] = tree
        runs: dict[str, list[tuple[float, float]]] = {}
        variants = [(rev, "native", trees[rev]) for rev in revisions]
        variants.append((f"static ({revisions[-1]})", "static", trees[revisions[-1]]))
        for _ in range(repeats):
            for name, backend, tree in variants:
                env = {**os.environ, "PYTHONPATH": str(tree)}
                timed_runs = "3" if backend == "native" else "1"
                out = subprocess.run([sys.executable, "-c", _HISTORY_SNIPPET, backend, preset,
                                      str(num_requests), timed_runs], env=env, check=True,
                                     capture_output=True, text=True).stdout.split()
                tokens = int(out[0])
                runs.setdefault(name, []).append((tokens / float(out[1]), tokens / float(out[2])))
    rows = [dict(revision=name, tokens_per_s=statistics.median(r[0] for r in rs),
                 cpu_tokens_per_s=statistics.median(r[1] for r in rs)) for name, rs in runs.items()]
    for row in rows:
        row["vs_first"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["cpu_vs_first"] = row["cpu_tokens_per_s"] / rows[0]["cpu_tokens_per_s"]
    return rows


def _print_history(rows: list[dict], preset: str, num_requests: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"native engine by revision ({preset}, {num_requests} requests, "
                        f"max batch {MAX_BATCH_SIZE}, 1 thread)")
    for col in ("revision", "tok/s (wall)", "vs first", "tok/s (CPU time)", "vs first (CPU)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["revision"], f"{r['tokens_per_s']:,.0f}", f"{r['vs_first']:.2f}x",
                      f"{r['cpu_tokens_per_s']:,.0f}", f"{r['cpu_vs_first']:.2f}x")
    Console(width=150).print(table)


def profile(preset: str, num_requests: int) -> None:
    """Where a native run's CPU time goes: torch profiler, top ops by self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(THREADS)
    model = build_preset(preset).eval()
    workload = build_workload(num_requests)
    run_native(model, workload, MAX_BATCH_SIZE, model.config.vocab_size)  # warm
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run_native(model, workload, MAX_BATCH_SIZE, model.config.vocab_size)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--history", nargs="+", metavar="REV",
                      help="time the native engine of these git revisions against each other")
    what.add_argument("--profile", action="store_true",
                      help="print where one native run spends its CPU time")
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--requests", type=int, default=512, help="workload size")
    parser.add_argument("--repeats", type=int, default=3, help="alternations for --history")
    parser.add_argument("--out", default=None, help="--history: write the rows as JSON")
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.preset, args.requests)
        return
    result = history(args.history, args.preset, args.requests, args.repeats)
    _print_history(result, args.preset, args.requests)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli()
