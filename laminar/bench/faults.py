"""`laminar bench faults`: a laminar-mode job killed on purpose, and what it cost.

    laminar bench faults [--quick] [--out docs/results/bench-faults.json]

One invocation runs the same seeded workload twice, each as a real `laminar train` process
tree (driver, Ray, pools, relays, rollouts, trainer):
1. **clean**: nothing is killed; its wall time sets the fault schedule and the throughput
   reference;
2. **faulty**: at seeded moments the benchmark sends SIGKILL to the process of a rollout
   (k times), of a relay (k times, the chain's master first), of the trainer (once), and to the
   whole job (once: the driver and every process under it), after which it runs
   `laminar resume RUN_DIR` at once, as an operator's supervisor would.

Process ids come from RUN_DIR/processes.json, which the driver keeps current; detection and
repair times from the rollout manager's fault records (RUN_DIR/faults-JOB.json, Unix times of
the manager's own clock) and, for the trainer and the whole job, from when the run's next
update appeared in RUN_DIR/metrics.jsonl (this process watches it every 0.1 s). Losses and
duplicates come from the run's own exactly-once check (laminar/pools/resume.py) and its
prompt-pool accounting.

JSON: `faults` (kind, who, at_s, detected_s, recovered_s, ...), `trajectories_lost`,
`trajectories_duplicated`, `recovery_s_by_kind`, `chain_repair_s`, `throughput_ratio_faulty_vs_clean`,
`resume_exact`, plus both runs' summaries and provenance. Targets (issue 17): 0 lost,
0 duplicated, rollout recovery <= 10 s, chain repair <= 1 s after detection, faulty throughput
>= 0.8 x clean.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path("runs/bench-faults")
LAMINAR = [sys.executable, "-m", "laminar.cli"]

WORKLOAD: dict[str, Any] = {  # laminar mode, 4 rollouts on two virtual nodes, heavy-tailed
    "name": "bench-faults", "mode": "laminar",
    "sft": {"enabled": False},
    "task": {"reverse": {"max_len": 16}, "eval_prompts": 16},
    "rollout": {"num_workers": 4, "group_size": 4, "batch_groups": 4, "max_new_tokens": 48,
                "engine": {"max_batch_size": 16}, "max_outstanding_batches": 2},
    "bench": {"env_latency": {"enabled": True, "median_s": 0.3, "sigma": 1.0, "max_s": 6.0}},
    "cluster": {"virtual_nodes": 2, "wait_timeout_s": 180, "heartbeat_s": 1.0},
    "manager": {"interval_s": 0.2},
    "relay": {"heartbeat_s": 0.2, "timeout_s": 2.0},
    "trainer": {"prompts_per_step": 8, "threads": 1, "total_steps": 150, "checkpoint_every": 5,
                "eval_every": 0},
    "metrics": {"live": False},
}


def schedule(seed: int, k: int, total_steps: int) -> list[tuple[int, float, str]]:
    """Seeded kills as (after this many updates have been logged, then this many seconds,
    kind): k rollouts, k relays (the first one the master), the trainer once, the whole job
    once; spread over updates 2 .. total_steps - 3, at least 2 updates apart, so each fault
    is recovered from before the next."""
    rng = random.Random(seed)
    kinds = ["rollout"] * k + ["relay"] * k + ["trainer", "job"]
    rng.shuffle(kinds)
    room = total_steps - 5 - 2 * (len(kinds) - 1)
    if room < 0:
        raise ValueError(f"{total_steps} updates are too few for {len(kinds)} kills 2 updates apart")
    cuts = sorted(rng.randint(0, room) for _ in kinds)
    return [(2 + c + 2 * i, round(rng.uniform(0.0, 1.0), 3), kind)
            for i, (c, kind) in enumerate(zip(cuts, kinds))]


# ---------------------------------------------------------------------------------------------
# A job as a process tree


class Job:
    """`laminar train` (or `laminar resume`) in its own process; reads its run directory."""

    def __init__(self, run_dir: Path, log: Path) -> None:
        self.run_dir, self.log = run_dir, log
        self.proc: subprocess.Popen | None = None
        self.offset = 0  # bytes of metrics.jsonl read so far
        self.arrivals: list[tuple[float, dict[str, Any]]] = []  # (unix time seen, metrics row)

    def start(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        with self.log.open("a") as f:
            f.write(f"\n$ laminar {' '.join(args)}\n")
        self.proc = subprocess.Popen([*LAMINAR, *args], stdout=self.log.open("a"),
                                     stderr=subprocess.STDOUT, env=env)

    def watch(self) -> None:
        """Stamp the metrics rows appended since the last call with the time they appeared
        (reads only the new bytes; a half-written last line waits for the next call)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        with path.open("rb") as f:
            f.seek(self.offset)
            new = f.read()
        now = time.time()
        complete = new[:new.rfind(b"\n") + 1]
        self.offset += len(complete)
        for raw in complete.splitlines():
            self.arrivals.append((now, json.loads(raw)))

    def steps(self) -> int:
        return sum(r.get("kind") == "step" for _, r in self.arrivals)

    def processes(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "processes.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_all(self) -> int:
        n = kill_tree(self.proc.pid)
        self.proc.wait(timeout=30)
        return n


def kill_tree(pid: int) -> int:
    """SIGKILL a process and every process under it (a job: the driver, Ray's processes, the
    actors); waits until they are gone; returns how many there were."""
    import psutil

    root = psutil.Process(pid)
    victims = [root, *root.children(recursive=True)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)
    return len(victims)


def run_clean(run_dir: Path, config: Path, log: Path) -> dict[str, Any]:
    job = Job(run_dir, log)
    t0 = time.time()
    job.start(["train", str(config)])
    while job.alive():
        job.watch()
        time.sleep(0.1)
    job.watch()
    if job.proc.returncode != 0:
        raise RuntimeError(f"the clean run failed (exit {job.proc.returncode}); see {log}")
    return {"wall_s": time.time() - t0, **outcome(run_dir, job)}


def run_faulty(run_dir: Path, config: Path, log: Path, plan: list[tuple[int, float, str]],
               seed: int) -> dict[str, Any]:
    rng = random.Random(seed + 1)
    job = Job(run_dir, log)
    t0 = time.time()
    job.start(["train", str(config)])
    kills: list[dict[str, Any]] = []
    pending = list(plan)
    due: float | None = None  # when the next kill fires, once its update count is reached
    relays_killed = 0
    while job.alive():
        job.watch()
        if pending and due is None and job.steps() >= pending[0][0]:
            due = time.time() + pending[0][1]
        if due is not None and time.time() >= due:
            at_step, _, kind = pending[0]
            kill = _kill(job, kind, rng, master=(kind == "relay" and relays_killed == 0))
            if kill is None:  # nothing of that kind to kill right now: a moment later
                due = time.time() + 0.5
            else:
                pending.pop(0)
                due = None
                kill |= {"at_s": round(kill["killed_at"] - t0, 3), "after_updates": job.steps()}
                kills.append(kill)
                relays_killed += kind == "relay"
                print(f"[bench faults] killed {kind} {kill['who']} at {kill['at_s']:.1f}s "
                      f"(after {kill['after_updates']} updates logged)", flush=True)
                if kind == "job":
                    job.start(["resume", str(run_dir)])
        time.sleep(0.1)
    job.watch()
    if job.proc.returncode != 0:
        raise RuntimeError(f"the faulty run failed (exit {job.proc.returncode}); see {log}")
    wall = time.time() - t0
    faults = [measure(k, job, run_dir) for k in kills]
    return {"wall_s": wall, "faults": faults, "not_done": [kind for _, _, kind in pending],
            **outcome(run_dir, job)}


def _kill(job: Job, kind: str, rng: random.Random, master: bool) -> dict[str, Any] | None:
    procs = job.processes()
    if kind == "job":
        n = job.kill_all()
        return {"kind": "job", "who": "driver and every process under it", "processes": n,
                "killed_at": time.time(), "job": procs.get("job")}
    if kind == "trainer":
        pid, who = procs.get("trainer"), "trainer"
    elif kind == "rollout":
        live = sorted(procs.get("rollouts", {}))
        if not live:
            return None
        who = rng.choice(live)
        pid = procs["rollouts"][who]
    else:
        chain = procs.get("chain", [])
        if len(chain) < 2:  # never kill the last relay: nothing would carry weights
            return None
        who = chain[0] if master else rng.choice(chain)
        pid = procs["relays"][who]
    if pid is None:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return {"kind": kind, "who": who, "pid": pid, "master": kind == "relay" and who == procs["chain"][0],
            "killed_at": time.time(), "job": procs.get("job")}


def measure(kill: dict[str, Any], job: Job, run_dir: Path) -> dict[str, Any]:
    """Seconds from the kill to its detection and to its recovery."""
    t = kill["killed_at"]
    out = {k: v for k, v in kill.items() if k != "killed_at"}
    if kill["kind"] in ("rollout", "relay"):
        record = _manager_fault(run_dir, kill)
        if record is None:
            return {**out, "detected_s": None, "recovered_s": None, "note": "no fault record"}
        out["detected_s"] = round(record["detected_at"] - t, 3)
        if kill["kind"] == "relay":
            out["recovered_s"] = round(record["repaired_at"] - t, 3)
            out["chain_repair_s"] = round(record["repaired_at"] - record["detected_at"], 3)
            out["chain_after"] = record.get("chain")
        else:
            done = record.get("recreated_at") or record.get("repaired_at")
            out["recovered_s"] = round(done - t, 3) if done else None
            out["handed_over_s"] = round(record["repaired_at"] - t, 3)
            out["replacement"] = record.get("replacement")
            out["moved"] = len(record.get("moved", {}))
        return out
    if kill["kind"] == "trainer":
        restart = _first(job, t, lambda r: r.get("kind") == "event" and r.get("what") == "trainer_restart")
        step = _first(job, t, lambda r: r.get("kind") == "step")
        return {**out, "detected_s": _since(restart, t), "recovered_s": _since(step, t)}
    resumed = _first(job, t, lambda r: r.get("kind") == "event" and r.get("what") == "resume")
    step = _first(job, t, lambda r: r.get("kind") == "step")
    return {**out, "detected_s": 0.0, "resumed_s": _since(resumed, t), "recovered_s": _since(step, t)}


def _first(job: Job, after: float, pred: Any) -> float | None:
    return next((seen for seen, row in job.arrivals if seen > after and pred(row)), None)


def _since(when: float | None, t: float) -> float | None:
    return None if when is None else round(when - t, 3)


def _manager_fault(run_dir: Path, kill: dict[str, Any]) -> dict[str, Any] | None:
    path = run_dir / f"faults-{kill['job']}.json"
    if not path.exists():
        return None
    records = [f for f in json.loads(path.read_text()) if f["kind"] == kill["kind"]
               and f["who"] == kill["who"] and f["detected_at"] >= kill["killed_at"] - 1.0]
    return records[0] if records else None


def outcome(run_dir: Path, job: Job) -> dict[str, Any]:
    """What the run trained, from its own report and audit."""
    report = json.loads((run_dir / "report.json").read_text())
    steps = [r for _, r in job.arrivals if r.get("kind") == "step"]
    kept_tokens = sum(r.get("batch_tokens", 0) for r in steps)
    acct, once = report["prompts"], report["exactly_once"]
    lost_groups = acct["issued"] - (acct["leased"] + acct["returned"] + acct["completed"])
    return {"exactly_once": once, "accounting": acct, "steps": len(steps),
            "trained_tokens_logged": kept_tokens,  # lost updates (rolled back by a restart) included
            "lost_groups": lost_groups}


# ---------------------------------------------------------------------------------------------


def main(quick: bool = False, out: str | None = None, seed: int = 0) -> dict[str, Any]:
    from laminar.bench.provenance import command_line, provenance

    workload = json.loads(json.dumps(WORKLOAD))
    k = 1 if quick else 2
    if quick:
        workload["trainer"]["total_steps"] = 30
    root = ROOT
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in ("clean", "faulty"):
        run_dir = root / name
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        config = root / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**workload, "run_dir": str(run_dir)}, sort_keys=False))
        log = root / f"{name}.log"
        log.write_text("")
        print(f"[bench faults] {name} run ({workload['trainer']['total_steps']} updates; log {log})",
              flush=True)
        if name == "clean":
            results[name] = run_clean(run_dir, config, log)
            plan = schedule(seed, k, workload["trainer"]["total_steps"])
            print("[bench faults] kills: " + ", ".join(f"{kind} after update {n} (+{d:.2f}s)"
                                                       for n, d, kind in plan), flush=True)
        else:
            results[name] = run_faulty(run_dir, config, log, plan, seed)
    report = summarize(results, k, workload)
    report["provenance"] = provenance(workload, command_line(sys.argv))
    print_table(report)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"[bench faults] wrote {out}")
    return report


def summarize(results: dict[str, Any], k: int, workload: dict[str, Any]) -> dict[str, Any]:
    clean, faulty = results["clean"], results["faulty"]
    by_kind: dict[str, list[float]] = {}
    for f in faulty["faults"]:
        if f.get("recovered_s") is not None:
            by_kind.setdefault(f["kind"], []).append(f["recovered_s"])
    chain = [f["chain_repair_s"] for f in faulty["faults"] if f.get("chain_repair_s") is not None]
    once = faulty["exactly_once"]
    return {
        "faults": faulty["faults"],
        "trajectories_lost": faulty["lost_groups"] * workload["rollout"]["group_size"]
        + len(once["incomplete"]),
        "trajectories_duplicated": len(once["duplicates"]),
        "recovery_s_by_kind": {kind: {"median": statistics.median(v), "max": max(v), "n": len(v)}
                               for kind, v in by_kind.items()},
        "chain_repair_s": {"median": statistics.median(chain), "max": max(chain)} if chain else None,
        # both final models hold trainer.total_steps updates of the same workload: the ratio of
        # updates per second is the ratio of wall times (restarts and lost updates included)
        "throughput_ratio_faulty_vs_clean": clean["wall_s"] / faulty["wall_s"],
        # the same without the whole-job restart's downtime (kill to the first update after
        # `laminar resume`): what the in-job faults cost on their own
        "throughput_ratio_without_job_restart": clean["wall_s"] / (faulty["wall_s"] - sum(
            f["recovered_s"] or 0.0 for f in faulty["faults"] if f["kind"] == "job")),
        "job_restart_s": [f.get("recovered_s") for f in faulty["faults"] if f["kind"] == "job"],
        "resume_exact": bool(once["ok"] and once["restarts"] >= 2),
        "clean": {k2: v for k2, v in clean.items()},
        "faulty": {k2: v for k2, v in faulty.items() if k2 != "faults"},
        "kills_per_kind": {"rollout": k, "relay": k, "trainer": 1, "job": 1},
        "targets": {"lost": 0, "duplicated": 0, "rollout_recovery_s": 10.0, "chain_repair_s": 1.0,
                    "throughput_ratio": 0.8},
    }


def print_table(report: dict[str, Any]) -> None:
    print("\nkind     who                 at_s  detected_s  recovered_s  note")
    for f in report["faults"]:
        note = ""
        if f["kind"] == "relay":
            note = f"chain repair {f.get('chain_repair_s')} s; chain now {f.get('chain_after')}" + \
                (" (master)" if f.get("master") else "")
        elif f["kind"] == "rollout":
            note = f"{f.get('moved')} trajectories moved; replaced by {f.get('replacement')}"
        elif f["kind"] == "job":
            note = f"{f.get('processes')} processes killed; resumed after {f.get('resumed_s')} s"
        print(f"{f['kind']:<8} {str(f['who'])[:18]:<18} {f['at_s']:>6.1f}  {_s(f.get('detected_s'))}  "
              f"{_s(f.get('recovered_s'))}  {note}")
    print(f"\ntrajectories lost {report['trajectories_lost']}, duplicated "
          f"{report['trajectories_duplicated']}; throughput faulty/clean "
          f"{report['throughput_ratio_faulty_vs_clean']:.3f} ("
          f"{report['throughput_ratio_without_job_restart']:.3f} without the whole-job restart's "
          f"downtime); exactly-once after the resume: "
          f"{report['resume_exact']}")
    if report["faulty"].get("not_done"):
        print(f"not done (the run ended first): {report['faulty']['not_done']}")


def _s(x: float | None) -> str:
    return f"{x:>10.2f}" if x is not None else f"{'-':>10}"
