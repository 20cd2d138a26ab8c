"""The tables `laminar bench modes` prints: throughput and its breakdown per schedule, time to
the held-out target, and the simulator's prediction beside the measurement."""

from __future__ import annotations

from typing import Any

from laminar.bench import learning


def fmt(x: float | None, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def print_tables(report: dict[str, Any], other_steps: int, breakdown_keys: tuple[str, ...]) -> None:
    """`other_steps`: the trainer steps of every schedule but sync; `breakdown_keys`: the
    per-update breakdown's columns."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    for title, s in (("env latency on", report),
                     ("control: env latency off", report.get("control_env_latency_off"))):
        if not s:
            continue
        target = s["heldout_target"]
        if s.get("heldout_target_note"):
            console.print(f"{title}: {s['heldout_target_note']} (sync's held-out "
                          f"{fmt(s['heldout_start'])} -> {fmt(s['heldout_start'] + s['sync_heldout_gain'])})")
        table = Table(title=f"laminar bench modes, {title}: sync {report['steps']} steps, the others "
                            f"{other_steps}; {report['repeats']} repeats "
                            "(medians; min-max)")
        for col in ("mode", "tok/s", "laminar/mode", "whole run s / update", "held-out start -> final",
                    f"time to held-out {fmt(target)}" if target is not None else learning.NO_GAIN,
                    "sync time / mode time", "staleness"):
            table.add_column(col)
        for m in s["throughput_by_mode"]:
            rng = s["ratio_laminar_vs_range"].get(m)
            final = s["heldout_final_by_mode"].get(m)
            ttt = s["time_to_heldout_target_s_by_mode"].get(m)
            sync_t = s["time_to_heldout_target_s_by_mode"].get("sync")
            table.add_row(
                m, f"{s['throughput_by_mode'][m]:.0f}",
                "-" if m == "laminar" or m not in s["ratio_laminar_vs"] else
                f"{s['ratio_laminar_vs'][m]:.2f}x" + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng else ""),
                f"{s['run_wall_s_per_update_by_mode'][m]:.2f}",
                "-" if final is None else f"{fmt(s['heldout_start'], '.2f')} -> {final['median']:.2f}",
                "-" if m not in s["time_to_heldout_target_s_by_mode"] else
                f"{ttt:.0f} s" if ttt is not None else "not reached",
                f"{sync_t / ttt:.2f}x" if ttt and sync_t else "-",
                " ".join(f"{k}:{v}" for k, v in s["staleness_hist_by_mode"].get(m, {}).items()))
        console.print(table)
    pred = report.get("simulator_prediction")
    if pred:
        console.print("simulator's prediction for this machine (laminar/mode): " + ", ".join(
            f"{m} {r:.2f}x predicted, {pred['measured_ratio_laminar_vs'][m]:.2f}x measured"
            for m, r in pred["predicted_ratio_laminar_vs"].items() if m in pred["measured_ratio_laminar_vs"]))
    if report.get("trl"):
        t = report["trl"]
        console.print(f"TRL {t['version']} ({t['setting']}; probes: "
                      f"{', '.join(f'{k} {v:.0f}' for k, v in t['probe_tokens_per_s'].items())} tok/s): "
                      f"{t['throughput']:.0f} tok/s over {t['steps']} steps, held-out greedy exact "
                      f"match at its end {t['final_heldout']:.2f}; laminar/TRL "
                      f"{report['ratio_laminar_vs']['trl']:.2f}x")
    detail = Table(title="where the time goes (means after warm-up, first repeat, env latency on)")
    for col in ("mode", "step s", "train s", "trainer idle", "rollout idle", "of it draining", "gen tok/s",
                "push stall s", "pull s", "KV util", "repacks"):
        detail.add_column(col)
    for m, b in report["breakdown_by_mode"].items():
        detail.add_row(m, *("-" if b[k] is None else f"{b[k]:.3g}" for k in (*breakdown_keys, "repacks")))
    console.print(detail)
    cpu = Table(title="where the CPU goes (CPU seconds over each mode's first run)")
    parts = ("TrainerActor", "RolloutActor", "PromptPool", "ExperienceBuffer", "PartialPool",
             "ManagerActor", "Relay", "driver", "ray daemons")
    for col in ("mode", "wall s", *parts, "rest (sandbox programs, others)", "machine cores busy",
                "CPU s per 1k trained tokens"):
        cpu.add_column(col)
    for m, c in report["cpu_by_mode"].items():
        cpu.add_row(m, f"{c['wall_s']:.0f}", *(f"{c['seconds'].get(p, 0):.1f}" for p in parts),
                    f"{c['rest_s']:.1f}", f"{c['machine_s'] / c['wall_s']:.2f}",
                    f"{c['per_trained_ktoken']:.3f}")
    console.print(cpu)
