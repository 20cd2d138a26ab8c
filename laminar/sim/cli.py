"""`laminar simulate`: what do the five schedules give on a cluster, a model, a workload?

    laminar simulate --model 7b --gpus 256                      # all modes, one point
    laminar simulate --model 32b --gpus 128 --mode laminar      # one mode
    laminar simulate --grid --out grid.json --plot fig11.png    # the paper's Fig. 11 grid
    laminar simulate --report docs/simulator.md                 # regenerate the fidelity report
    laminar simulate --calibration local.json                   # a measured machine (local.py)

Prints a table, writes JSON (`--out`; for a point: `model`, `gpus`, `throughput_by_mode`,
`details`; for `--grid`: `points`, a list of those, and `fidelity`, fitted vs held-out ratios
as `fit.fidelity` counts them) and a Fig. 11-style bar chart (`--plot`). `--quick`
simulates fewer updates, coarser. Bad arguments exit 2 with a message naming what is allowed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from laminar.provenance import provenance
from laminar.sim import paper
from laminar.sim.calibration import Calibration
from laminar.sim.fit import fidelity
from laminar.sim.report import grid_table, local_table, plot, point_table
from laminar.sim.report_md import write_report
from laminar.sim.run import MEASURE, QUICK_MEASURE, QUICK_WARMUP, WARMUP, simulate_grid, simulate_point


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's exit code 2, our prefix
        self.print_usage(sys.stderr)
        raise _BadArgs(message)


class _BadArgs(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="laminar simulate", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=paper.MODELS, default="7b")
    p.add_argument("--gpus", type=int, default=None,
                   help="total GPUs, a scale of the paper's Table 2 (default: the largest)")
    p.add_argument("--mode", default="all", choices=("all",) + paper.MODES)
    p.add_argument("--grid", action="store_true", help="every model and scale of Fig. 11")
    p.add_argument("--report", metavar="MD", help="rewrite the generated sections of this "
                   "markdown file (docs/simulator.md) from a fresh grid run")
    p.add_argument("--calibration", metavar="JSON", help="calibration overrides; a `local` "
                   "block simulates a measured machine instead of the paper's testbed")
    p.add_argument("--tool-calls", type=int, default=None, metavar="N",
                   help="agentic workload: up to N tool calls per trajectory (default 0)")
    p.add_argument("--tool-latency", type=float, default=None, metavar="S",
                   help="median tool-call latency in seconds (log-normal, sigma 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer updates, coarser steps (~1 min)")
    p.add_argument("--out", metavar="JSON", help="write the results here")
    p.add_argument("--plot", metavar="PNG", help="Fig. 11-style bar chart")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        return _run(args)
    except _BadArgs as e:
        print(f"laminar simulate: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)


def _run(args: argparse.Namespace) -> int:
    cal, local = Calibration(), None
    if args.calibration:
        try:
            cal, local = Calibration.from_json(args.calibration)
        except (OSError, ValueError, TypeError) as e:
            raise _BadArgs(f"--calibration {args.calibration}: {e}") from e
    if args.tool_calls is not None:
        if args.tool_calls < 0:
            raise _BadArgs(f"--tool-calls {args.tool_calls}: must be >= 0")
        cal = cal.with_overrides(tool_calls_max=args.tool_calls)
    if args.tool_latency is not None:
        if args.tool_latency <= 0:
            raise _BadArgs(f"--tool-latency {args.tool_latency}: must be > 0 seconds")
        cal = cal.with_overrides(tool_median_s=args.tool_latency)
    warmup, measure = (QUICK_WARMUP, QUICK_MEASURE) if args.quick else (WARMUP, MEASURE)
    if args.quick:
        cal = cal.with_overrides(decode_quantum=max(cal.decode_quantum, 32))
    modes = paper.MODES if args.mode == "all" else (args.mode,)
    t0 = time.time()
    if local is not None:
        out: Any = local_table(local, cal, modes, args.seed, warmup, measure)
    elif args.grid or args.report:
        grid = simulate_grid(cal=cal, seed=args.seed, warmup=warmup, measure=measure,
                             modes=modes)
        grid_table(grid)
        out = {"points": grid, "fidelity": fidelity(grid), "provenance": provenance(vars(args))}
        _print_fidelity(out["fidelity"])
        if args.report:
            write_report(Path(args.report), grid, cal, warmup, measure, args)
    else:
        gpus = args.gpus if args.gpus is not None else paper.SCALES[args.model][-1]
        if gpus not in paper.SCALES[args.model]:
            raise _BadArgs(f"--gpus {gpus} is not a {args.model} scale of the paper's Table 2; "
                           f"allowed for {args.model}: "
                           f"{', '.join(map(str, paper.SCALES[args.model]))}")
        out = simulate_point(args.model, gpus, modes, cal, args.seed, warmup, measure)
        point_table(out)
    print(f"simulated in {time.time() - t0:.1f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        points = out["points"] if "points" in out else [out]
        plot([p for p in points if p.get("model") in paper.MODELS], Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _print_fidelity(f: dict[str, Any]) -> None:
    def side(name: str) -> str:
        n, ok = f[f"{name}_points"], f[f"{name}_within_25pct"]
        return f"{ok} of {n}" if n else "none simulated"

    worst = f["heldout_worst_error"]
    print(f"within ±25% of the paper: fitted ratios {side('fit')}, held-out {side('heldout')}"
          + (f"; worst held-out {worst['ratio']} {worst['error']:+.0%}" if worst else "")
          + f" ({f['fitted_constants']['count']} constants fitted on the fit set)")
