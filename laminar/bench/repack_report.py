"""What `laminar bench repack` prints: laminar mode with and without repack, the move cost and
the simulator's cluster-scale check."""

from __future__ import annotations

from typing import Any


def print_report(r: dict[str, Any], targets: dict[str, float]) -> None:
    def f(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    lat_w, lat_wo = r["traj_latency_avg_max_with"], r["traj_latency_avg_max_without"]
    print(f"generation tokens/s: with {f(r['gen_tokens_per_s_with'], '.0f')}, without "
          f"{f(r['gen_tokens_per_s_without'], '.0f')}; gain {r['gain']:.3f} (paired, range "
          f"{r['gain_range'][0]:.3f}-{r['gain_range'][1]:.3f}; target >= {targets['gain']})")
    print(f"KV utilisation (rollouts with work): with {f(r['kv_util_with'])}, without "
          f"{f(r['kv_util_without'])}; counting idle rollouts: {f(r['kv_util_all_with'])} vs "
          f"{f(r['kv_util_all_without'])}")
    print(f"trajectory latency avg/max (s): with {f(lat_w[0])}/{f(lat_w[1], '.2f')}, without "
          f"{f(lat_wo[0])}/{f(lat_wo[1], '.2f')}")
    print(f"training tokens/s: with {f(r['train_tokens_per_s_with'], '.0f')}, without "
          f"{f(r['train_tokens_per_s_without'], '.0f')}")
    print(f"rollout time (with / without): admitting {f(r['frac_admitting_with'])} / "
          f"{f(r['frac_admitting_without'])}, draining a tail {f(r['frac_draining_with'])} / "
          f"{f(r['frac_draining_without'])}, nothing in flight {f(r['frac_empty_with'])} / "
          f"{f(r['frac_empty_without'])}; admission closed (prompt pool at its cap) "
          f"{f(r['frac_admission_closed_with'])} / {f(r['frac_admission_closed_without'])}")
    print(f"repacks {f(r['repacks'], '.0f')} moving {f(r['moved'], '.0f')} trajectories (medians); "
          f"{f(r['repack_overhead_s'])} s per repack, re-prefill {f(r['reprefill_s_per_repack'], '.4f')} s")
    print(f"targets: {r['targets']}")
    cw, cwo = r["cpu_s_with"], r["cpu_s_without"]
    print("CPU s per run (with / without): " + ", ".join(
        f"{k} {cw[k]:.1f} / {cwo[k]:.1f}" for k in cw) + f"; manager checks {f(r['checks_with'], '.0f')} / "
        f"{f(r['checks_without'], '.0f')}")
    mc = r["move_cost"]
    print(f"a forced move ({mc['moves']} moves between live rollouts, no trainer): "
          f"{mc['per_move_s_median']:.3f} s ({mc['per_move_s_range'][0]:.3f}-"
          f"{mc['per_move_s_range'][1]:.3f}), {mc['moved_per_move_median']:.0f} trajectories, "
          f"re-prefill {mc['reprefill_tokens_per_move']:.0f} tokens in {mc['reprefill_s_per_move']:.4f} s")
    s = r["simulator"]
    print(f"simulator, this machine's curve: gain {s['this_machine']['gain']:.3f} "
          f"({s['this_machine']['with']['repacks']} repacks); the paper's Table 1 setting on "
          f"GPUs: gain {s['paper_table1_gpu']['gain']:.3f}")
