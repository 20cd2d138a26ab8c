"""The results index: one table of every result JSON in a folder, with its provenance.

    python -m laminar.bench.results docs/results      # writes docs/results/README.md
    laminar bench index [--out docs/results/README.md]

Each JSON that carries a `provenance` key (see provenance.py) becomes a row: its headline
figure, the command that wrote it, commit, date and machine. The headline is picked by the keys
the JSON has — engine, relay, simulator grid, bench modes, bench faults, bench repack, bench
trainer or bench lora — and quotes the numbers their docs quote. JSONs without provenance are listed by file name under
"older results".
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

INDEX = "README.md"


def write_index(results_dir: Path, out: Path | None = None) -> Path:
    """Write the index of `results_dir`/*.json to `out` (default: README.md in that folder)."""
    out = out if out is not None else results_dir / INDEX
    files = sorted(results_dir.glob("*.json"))
    if not files:
        raise SystemExit(f"no *.json in {results_dir}: nothing to index")
    out.write_text(render({f.name: json.loads(f.read_text()) for f in files}))
    return out


def render(results: dict[str, Any]) -> str:
    """The markdown index of {file name: parsed JSON}."""
    rows, older = [], []
    for name, data in results.items():
        if isinstance(data, dict) and isinstance(data.get("provenance"), dict):
            p = data["provenance"]
            rows.append([f"[{name}]({name})", headline(data), f"`{p.get('command') or '?'}`",
                         _commit(p), _date(p), _machine(p)])
        else:
            older.append(name)
    lines = ["# Results", "",
             "Written by `python -m laminar.bench.results docs/results` (`make bench` runs every",
             "benchmark, then this). Each row is one JSON in this folder; the figure is its",
             "headline, the rest is its `provenance`.", "",
             "| file | figure | command | commit | date | machine |",
             "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    if older:
        lines += ["", "## Older results (no provenance)", ""]
        lines += [f"- [{name}]({name})" for name in older]
    return "\n".join(lines) + "\n"


def headline(data: dict[str, Any]) -> str:
    """The numbers the docs quote from this result, recognised by its keys."""
    if "presets" in data and "ratio_native_vs_static" in data:
        return _engine(data)
    if "chain_ratio_p8_p2" in data:
        return _relay(data)
    if "fidelity" in data:
        return _simulator(data["fidelity"])
    if "ratio_laminar_vs" in data:
        return _modes(data)
    if "throughput_ratio_faulty_vs_clean" in data:
        return _faults(data)
    if "gen_tokens_per_s_with" in data:
        return _repack(data)
    if "tokens_per_s_by_world" in data:
        return _trainer(data)
    if "push_bytes_by_variant" in data:
        return _lora(data)
    if "time_to_target_s" in data and "lags" in data:
        return _staleness(data)
    if data.get("benchmark") == "sandbox" and "ratio" in data["rows"]["sandbox CPU ms / call"]:
        return _sandbox(data["rows"])
    if "delta_bytes_ratio_by_lr" in data:
        return _relay_delta(data)
    return "—"


def _staleness(d: dict[str, Any]) -> str:
    """Per correction: time to the held-out target and final score at each lag."""
    def cell(kind: str, lag: str) -> str:
        t, f = d["time_to_target_s"][kind].get(lag), d["heldout_final"][kind].get(lag)
        return (f"lag {lag} {'not reached' if t is None else f'{t:.0f} s'}"
                + ("" if f is None else f" ({f:.3f})"))
    target = d.get("heldout_target")
    return (f"{d['task']}, {d['steps']} steps x {d['repeats']} repeat(s), {d.get('metric', 'greedy_exact_match')} "
            f"{d['heldout_start']:.3f} -> target {'none' if target is None else f'{target:.3f}'}; time to "
            "target (final score): " + "; ".join(
                f"{kind}: " + ", ".join(cell(kind, str(lag)) for lag in d["lags"])
                for kind in d["corrections"]))


def _sandbox(rows: dict[str, Any]) -> str:
    cpu, warm = rows["sandbox CPU ms / call"], rows["warm (ready) median ms"]
    return (f"print(1) zygote vs one-shot: sandbox CPU per call {cpu['ratio']:.2f}x "
            f"({cpu['zygote']:.2f} vs {cpu['oneshot']:.1f} ms), warm latency median "
            f"{warm['ratio']:.2f}x, cold median {rows['cold median ms']['ratio']:.2f}x")


def _relay_delta(d: dict[str, Any]) -> str:
    return ("delta / whole bytes in bf16 by lr " + ", ".join(
        f"{lr} {r:.3f}" for lr, r in d["delta_bytes_ratio_by_lr"].items())
        + f"; 4-relay chain time {d['delta_chain_time_ratio']:.2f}x, push stall "
        f"{d['delta_push_stall_ratio']:.2f}x, late joiner {d['late_join_ratio']:.2f}x one whole "
        f"transfer; exact {d['delta_exact']}")


def _lora(d: dict[str, Any]) -> str:
    return "LoRA vs full weights per version: " + "; ".join(
        f"{name} bytes {q['push_bytes']:.3f}x, push stall {q['push_stall']:.2f}x, rollout apply "
        f"{q['apply']:.2f}x" for name, q in d["ratios_vs_full"].items())


def _trainer(d: dict[str, Any]) -> str:
    r, one = d["ratios"], d["push_stall_s_by_world"]["1"]
    ddp = (d.get("by_sharding_world2") or {}).get("none")
    grad_op = (d.get("by_mode_world2") or {}).get("grad_op")
    return (f"2 trainer ranks vs 1 (FSDP full): tokens/s {r['throughput_2_vs_1']:.2f}x"
            + (f" (FSDP grad_op {grad_op['ratios']['throughput_2_vs_1']:.2f}x, parameter+optimizer "
               f"{grad_op['ratios']['param_optim_mem_2_vs_1']:.2f}x)" if grad_op else "")
            + (f" (DDP {ddp['tokens_per_s'] / d['tokens_per_s_by_world']['1']:.2f}x)" if ddp else "")
            + f", parameter+optimizer memory per rank {r['param_optim_mem_2_vs_1']:.2f}x, push "
            f"stall {r['push_stall_2_vs_1']:.2f}x ({one * 1e3:.1f} ms at 1; gathered on rank 0 "
            f"{d['push_stall_s_gather_world2'] / one:.2f}x); loss match {d['loss_match_max_abs']:.1e}")


def _repack(d: dict[str, Any]) -> str:
    lo, hi = d["gain_range"]
    lw, lwo = d["traj_latency_avg_max_with"], d["traj_latency_avg_max_without"]
    return (f"generation tokens/s with/without repack {d['gain']:.2f}x ({lo:.2f}-{hi:.2f}; "
            f"{d['gen_tokens_per_s_with']:,.0f} vs {d['gen_tokens_per_s_without']:,.0f}); KV "
            f"{d['kv_util_with']:.3f} vs {d['kv_util_without']:.3f}; latency avg "
            f"{lw[0]:.3f} vs {lwo[0]:.3f} s; repacks per run {_span(d['range']['repacks']['with'])} "
            f"moving {_span(d['range']['moved']['with'])} trajectories")


def _span(lo_hi: list[float]) -> str:
    lo, hi = lo_hi
    return f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"


def _faults(d: dict[str, Any]) -> str:
    rec = ", ".join(f"{kind} {v['median']:.2f} s" for kind, v in d["recovery_s_by_kind"].items())
    chain = d.get("chain_repair_s") or {}
    return (f"lost {d['trajectories_lost']}, duplicated {d['trajectories_duplicated']}; recovery "
            f"(median) {rec}; chain repair max {chain.get('max', float('nan')):.3f} s; faulty/clean "
            f"throughput {d['throughput_ratio_faulty_vs_clean']:.2f} "
            f"({d['throughput_ratio_without_job_restart']:.2f} without the whole-job restart)")


def _engine(d: dict[str, Any]) -> str:
    parts = [f"{name}: native vs static {r['ratio_native_vs_static']:.2f}x tokens/s "
             f"({r['native_tokens_per_s']:,.0f} vs {r['static_tokens_per_s']:,.0f}; "
             f"CPU time {r['ratio_native_vs_static_cpu']:.2f}x; ideal {r['ideal_ratio']:.2f}x)"
             + (_backends(r) if "backends" in r else "")
             for name, r in d["presets"].items()]
    return "; ".join(parts)


def _backends(r: dict[str, Any]) -> str:
    """`--backend native,vllm`: vLLM against native on the same workload."""
    b = r["backends"]
    return (f", vLLM vs native {r['ratio_vllm_vs_native']:.2f}x tokens/s, weight load "
            f"{b['vllm']['load_s_per_mb'] * 1e3:.2f} vs {b['native']['load_s_per_mb'] * 1e3:.2f} ms/MB "
            f"(load_state_dict {r['load_state_dict_s_per_mb'] * 1e3:.2f}), log-prob |d| p99 vs the "
            f"trainer {r['logprob_abs_diff_p99_vllm']:.1e}")


def _relay(d: dict[str, Any]) -> str:
    size = d.get("headline_size", "")
    chain_model = ", ".join(f"p{p} {v:.2f}" for p, v in d.get("chain_over_model_by_p", {}).items())
    return (f"{size}: chain p8/p2 {d['chain_ratio_p8_p2']:.2f}x time; star/chain p8 "
            f"{d['star_over_chain_p8']:.2f}x; push stall p8/p2 {d['push_stall_ratio_p8_p2']:.2f}; "
            f"pull/memcpy {d['pull_over_memcpy']:.2f}; chain/model {chain_model}")


def _simulator(f: dict[str, Any]) -> str:
    worst = f.get("heldout_worst_error") or {}
    text = (f"held out: {f['heldout_within_25pct']} of {f['heldout_points']} ratios within ±25%")
    if worst:
        text += f", worst {worst['ratio']} {worst['error']:+.0%}"
    text += f"; fitted: {f['fit_within_25pct']} of {f['fit_points']}"
    constants = f.get("fitted_constants") or {}
    if "count" in constants:
        text += f"; {constants['count']} constants fitted"
    return text


def _modes(d: dict[str, Any]) -> str:
    parts = ["laminar vs " + _ratios(d["ratio_laminar_vs"])]
    control = d.get("control_env_latency_off")
    if isinstance(control, dict):
        control = control.get("ratio_laminar_vs", control)
        if all(isinstance(v, (int, float)) for v in control.values()):
            parts.append("env latency off: " + _ratios(control))
    if d.get("heldout_start") is not None and d.get("heldout_target") is not None:
        parts.append(f"held-out start {d['heldout_start']:.3f}, target {d['heldout_target']:.3f}")
    reached = d.get("time_to_heldout_target_s_by_mode")
    if isinstance(reached, dict):
        parts.append("time to held-out target: " + ", ".join(
            f"{mode} {'never' if s is None else f'{s:.0f} s'}" for mode, s in reached.items()))
    return "; ".join(parts)


def _ratios(by_mode: dict[str, float]) -> str:
    """Cut to two decimals, never rounded up (1.195x against a 1.2x target reads 1.19x)."""
    return ", ".join(f"{mode} {math.floor(r * 100) / 100:.2f}x" for mode, r in by_mode.items())


def _commit(p: dict[str, Any]) -> str:
    if not p.get("commit"):
        return "not a git checkout"
    return f"`{p['commit'][:7]}`" + (" (dirty)" if p.get("dirty") else "")


def _date(p: dict[str, Any]) -> str:
    date = p.get("date") or "?"
    return date.replace("T", " ").replace("+00:00", " UTC")


def _machine(p: dict[str, Any]) -> str:
    return f"{p.get('cpu') or '?'}, {p.get('cores') or '?'} cores"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(quick: bool = False, out: str | None = None) -> Path:
    """`laminar bench index`: index the folder of `out` (default docs/results/README.md).

    `quick` is accepted for the shape every `laminar bench` entry shares; indexing measures
    nothing, so it changes nothing.
    """
    target = Path(out) if out else Path("docs/results") / INDEX
    written = write_index(target.parent, target)
    print(f"wrote {written}")
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit("usage: python -m laminar.bench.results RESULTS_DIR")
    main(out=str(Path(sys.argv[1]) / INDEX))
