"""What every schedule's driver shares: following the trainer while logging the run's rows
(laminar/metrics.py: trainer steps joined with what the rollouts did meanwhile, held-out
evaluations, timeline spans, events), the held-out evaluation schedule, and the final
accounting. Talks to the runtime only through its driver API (laminar/runtime/__init__.py), so
it runs on either backend."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import yaml

from laminar.metrics import MetricsLogger, evenly, read_metrics, read_rows, reward_trend
from laminar.modes.common import start_step
from laminar.pools.resume import check_lineage
from laminar.rollout.evals import EvalJob
from laminar.rollout.requests import sampling_params
from laminar.runtime import TrainerRestarted


class Follower:
    """Turns trainer rows into metrics rows, adding what the rollouts did meanwhile (generation
    tokens/s, idle fraction, KV utilisation per rollout, pulls, repacks, environment latencies),
    and schedules the held-out evaluations: at the start, every `trainer.eval_every` versions,
    and at the end (`final_eval`), each run by the next rollout in turn while training goes on."""

    def __init__(self, rt: Any) -> None:
        from laminar.live import LiveView
        from laminar.sinks import open_sinks

        self.rt, self.cfg = rt, rt.cfg
        cfg = self.cfg
        run_dir = cfg.resolved_run_dir
        self.logger = MetricsLogger(run_dir, cfg.trainer.total_steps, console=False,
                                    fresh=not (cfg.trainer.from_checkpoint or cfg.resume),
                                    sinks=open_sinks(cfg.metrics, run_dir, cfg.name, cfg.model_dump(mode="json")),
                                    t0=rt.started_at)  # time 0: the rollouts' start, in every mode
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        self.view = LiveView(cfg.trainer.total_steps, cfg.metrics.live)
        self.view.__enter__()
        self.seen = 0
        self.version = rt.start_version  # of the newest trainer row logged
        self.step: int | None = None  # its update count (trainer.total_steps counts those)
        self.last_t = time.monotonic()
        self.last_counters: dict[str, Any] = {}
        self.kv_samples: dict[str, list[float]] = {}
        self.env_latency: list[float] = []
        self.turns: list[int] = []  # turns of multi-turn episodes ended since the last row
        self.last_manager: dict[str, Any] = rt.manager_stats()  # events are what changes
        self.chain: list[str] = self.last_manager["chain"]
        self.evals_asked: dict[str, tuple[str, EvalJob]] = {}  # id -> (rollout, job)
        self.evals_done: set[str] = set()
        self.next_clock_eval = time.time() + cfg.trainer.eval_every_s  # trainer.eval_every_s
        self.newest_evaluated = -1  # the newest version an evaluation has reported on
        self.restarts = 0  # trainer restarts seen
        self.published_key = ""  # what processes.json / faults-JOB.json last said
        self.status_at = -1e9  # when RUN_DIR/status.json was last written
        if cfg.resume:
            summary = getattr(rt, "resumed", None)
            self.log_event("resume", f"the job resumed in {run_dir}: " + (
                summary.line() if summary else f"model from version {rt.start_version}"))
        elif cfg.trainer.from_checkpoint:
            self.log_event("resume", f"resumed from {cfg.trainer.from_checkpoint} at version {rt.start_version}")
        self.ask_eval(step=start_step(cfg), at_least=rt.start_version)

    # ------------------------------------------------------------------------- evaluation

    def ask_eval(self, step: int, at_least: int) -> str:
        """Evaluate version `at_least` (or newer) as of update `step`; once per version."""
        eval_id = f"v{at_least}"
        if eval_id not in self.evals_asked:
            job = EvalJob(eval_id, step, at_least, self.rt.task.eval, sampling_params(self.cfg))
            self.evals_asked[eval_id] = (self.rt.request_eval(job), job)
        return eval_id

    def _clock_eval(self) -> None:
        """trainer.eval_every_s: every so many wall-clock seconds, the newest version (once per
        version: a version already asked for is not evaluated twice)."""
        every = self.cfg.trainer.eval_every_s
        if every and time.time() >= self.next_clock_eval:
            self.next_clock_eval += every * max(1, int((time.time() - self.next_clock_eval) // every) + 1)
            if self.version > self.newest_evaluated:  # an evaluation may have run on a newer one
                self.ask_eval(step=self.step or 0, at_least=self.version)

    def _reassign_evals(self, live: list[str]) -> None:
        """An evaluation whose rollout died or left is asked of another one."""
        for eval_id, (wid, job) in list(self.evals_asked.items()):
            if eval_id not in self.evals_done and wid not in live:
                self.evals_asked[eval_id] = (new := self.rt.request_eval(job), job)
                if wid is not None and new is not None:
                    self.log_event("eval_moved", f"held-out evaluation {eval_id} moved from {wid}")

    def final_eval(self) -> None:
        """The held-out score of the last version; waits for it (and any still running)."""
        self.ask_eval(step=self.step if self.step is not None else start_step(self.cfg),
                      at_least=self.version)
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        while set(self.evals_asked) - self.evals_done and time.monotonic() < deadline:
            self.rt.idle(0.2)
            self.poll()
        missing = sorted(set(self.evals_asked) - self.evals_done)
        if missing:
            self.log_event("eval_missing", f"held-out evaluations {missing} never reported "
                           "(their rollout died or retired)")

    # ------------------------------------------------------------------------- rows

    def log_event(self, what: str, detail: str) -> None:
        self.view.row(self.logger.write("event", {"what": what, "detail": detail}))

    def poll(self) -> int:
        """Log what arrived since the last poll; returns how many trainer rows."""
        rows = self.rt.trainer_rows(self.seen)
        snaps = self.rt.snapshots()
        for w, snap in snaps.items():
            if snap.num_in_flight:
                self.kv_samples.setdefault(w, []).append(snap.kv_utilization)
        self._records(self.rt.take_records())
        manager = self.rt.manager_stats()
        self._events(manager)
        self._publish(manager)
        self._control(manager, snaps)
        self._reassign_evals(manager["workers"])
        self.view.update(self._live_state(snaps, manager))
        if not rows:
            self._clock_eval()
            return 0
        now = time.monotonic()
        wall, self.last_t = now - self.last_t, now
        gen, idle, pulls, pull_s, gen_by = 0, 0.0, 0, 0.0, {}
        for w, s in snaps.items():
            c, prev = s.counters, self.last_counters.get(w)
            if prev is not None:
                gen_by[w] = (c.generated_tokens - prev.generated_tokens) / wall if wall > 0 else None
                gen += c.generated_tokens - prev.generated_tokens
                idle += c.idle_s - prev.idle_s
                pulls += c.pulls - prev.pulls
                pull_s += c.pull_s - prev.pull_s
            self.last_counters[w] = c
        kv_all = [v for samples in self.kv_samples.values() for v in samples]
        extra = {
            "gen_tokens_per_s": gen / wall if wall > 0 else None,
            "gen_tokens_per_s_by_rollout": gen_by,
            "rollout_idle_frac": idle / (wall * max(1, len(snaps))) if wall > 0 else None,
            "kv_util_mean": float(np.mean(kv_all)) if kv_all else 0.0,
            "kv_util_by_rollout": {w: float(np.mean(v)) for w, v in self.kv_samples.items() if v},
            "pulls": pulls, "pull_latency_s": pull_s / pulls if pulls else None,
            "repacks": manager["repacks"], "moved_trajectories": manager["moved_trajectories"],
            "env_latency_s": evenly(self.env_latency, 64),
            "turns": evenly(self.turns, 64),
            # cumulative over the live rollouts: failed trajectories by reason, tool calls by status
            "failed_by_reason": _summed(s.counters.failed_by_reason for s in snaps.values()),
            "tool_calls": _summed(s.counters.tool_calls for s in snaps.values()),
        }
        self.kv_samples, self.env_latency, self.turns = {}, [], []
        every, total = self.cfg.trainer.eval_every, self.cfg.trainer.total_steps
        for row in rows:
            spans = row.pop("spans", [])
            published = row.pop("published_at", None)  # the update's own time, not this poll's
            row = {**row, **extra, "mode": self.cfg.mode}
            if published is not None:
                row["time"] = self.logger.since_start(published)
            step_s = row.get("update_interval_s")
            row["trainer_idle_frac"] = row["trainer_idle_s"] / step_s if step_s else None
            self.view.row(self.logger.log(row["version"], row))
            self.version, self.step = row["version"], row.get("step", row["version"])
            for what, start, end in spans:
                self.logger.write("span", {"who": "trainer", "what": what, "version": row["version"],
                                           "start": self.logger.since_start(start),
                                           "end": self.logger.since_start(end)})
            if every and self.step % every == 0 and self.step < total:
                self.ask_eval(step=self.step, at_least=row["version"])
        self.seen += len(rows)
        self._clock_eval()
        return len(rows)

    def _records(self, records: dict[str, dict[str, Any]]) -> None:
        for w, rec in records.items():
            for result in rec["evals"]:
                self.evals_done.add(result["eval_id"])
                self.newest_evaluated = max(self.newest_evaluated, result["version"])
                self.view.row(self.logger.write("eval", {**result, "rollout": w}))
            for span in rec["spans"]:
                self.logger.write("span", {"who": w, "what": span.what, "version": span.version,
                                           "start": self.logger.since_start(span.start),
                                           "end": self.logger.since_start(span.end)})
            self.env_latency += rec["env_latency_s"]
            self.turns += rec.get("turns", [])

    def _events(self, manager: dict[str, Any]) -> None:
        last = self.last_manager
        if last:
            if manager["repacks"] > last["repacks"]:
                self.log_event("repack", f"{manager['repacks'] - last['repacks']} repack(s), "
                               f"{manager['moved_trajectories'] - last['moved_trajectories']} "
                               "trajectories moved to a same-version peer")
            for dead in manager["dead"][len(last["dead"]):]:
                self.log_event("failure", f"rollout {dead} died; its unfinished trajectories "
                               "continue on live rollouts")
            recreated = manager.get("recreated", [])  # the local backend has no manager
            for dead, new in recreated[len(last.get("recreated", [])):]:
                self.log_event("recreated", f"rollout {new} started in place of {dead}")
            before, now = set(last["workers"]), set(manager["workers"])
            for wid in sorted(now - before - {new for _, new in recreated}):
                self.log_event("join", f"rollout {wid} joined the job")
            for j in manager.get("nodes_joined", [])[len(last.get("nodes_joined", [])):]:
                self.log_event("node", f"node {j['node']} joined the cluster: relay {j['relay']} "
                               f"at the chain's tail, rollouts {', '.join(j['rollouts'])}")
            for wid in sorted(before - now - set(manager["dead"])):
                self.log_event("leave", f"rollout {wid} left the job (its work moved to peers)")
        if manager["chain"] != self.chain:
            self.log_event("chain", f"the relay chain is now {manager['chain']} (was {self.chain})")
        self.chain = manager["chain"]
        self.last_manager = manager

    def _publish(self, manager: dict[str, Any]) -> None:
        """RUN_DIR/processes.json (which process is which) and RUN_DIR/faults-JOB.json (the
        manager's fault records), rewritten when they change: for an operator's scripts and
        `laminar bench faults`, which kill processes by these ids."""
        if not hasattr(self.rt, "process_ids"):
            return  # one process: nothing to name
        key = json.dumps([manager["workers"], manager["chain"], manager.get("faults"), self.restarts])
        if key == self.published_key:
            return
        run_dir = self.cfg.resolved_run_dir
        ids = self.rt.process_ids(manager)
        if ids["trainer"] is None:
            return  # restarting: try again at the next poll
        _write_json(run_dir / "processes.json", ids)
        _write_json(run_dir / f"faults-{ids['job']}.json", manager.get("faults", []))
        self.published_key = key

    def _control(self, manager: dict[str, Any], snaps: dict[str, Any], finished: bool = False) -> None:
        """RUN_DIR/status.json (at most once a second) and the requests of `laminar scale`
        (laminar/modes/control.py)."""
        from laminar.modes import control

        run_dir = self.cfg.resolved_run_dir
        if not hasattr(self.rt, "process_ids"):
            for path, _ in control.pending_requests(run_dir):
                control.answer(path, {"ok": False, "message": "the local backend (one process) "
                                      "cannot add or remove rollouts; run with cluster.backend=ray"})
            return
        requests = control.pending_requests(run_dir)
        for path, request in requests:
            reply = self._apply(request, manager)
            manager, snaps = self.rt.manager_stats(), self.rt.snapshots()
            control.write_status(run_dir, self._status(manager, snaps, finished))  # before the reply
            control.answer(path, reply)
        now = time.monotonic()
        if finished or requests or now - self.status_at >= control.STATUS_EVERY_S:
            self.status_at = now
            control.write_status(run_dir, self._status(manager, snaps, finished))

    def _apply(self, request: dict[str, Any], manager: dict[str, Any]) -> dict[str, Any]:
        from laminar.modes.control import plan_scale

        live = [w for w in manager["workers"] if w not in manager["dead"]]
        try:
            add, remove = plan_scale(request, live)
            added = self.rt.scale_up(add, bool(request.get("new_node"))) if add else []
            moved = {wid: self.rt.retire_worker(wid) for wid in remove}
        except (ValueError, RuntimeError) as e:
            self.log_event("scale_refused", str(e))
            return {"ok": False, "message": str(e)}
        parts = ([f"starting {', '.join(added)} (they join once they answer)"] if added else []) + [
            f"{wid} left ({n} trajectories moved to peers)" for wid, n in moved.items()]
        message = "; ".join(parts) or "nothing to do"
        self.log_event("scale", message)
        return {"ok": True, "message": message, "added": added, "removed": list(moved)}

    def _status(self, manager: dict[str, Any], snaps: dict[str, Any], finished: bool) -> dict[str, Any]:
        nodes = self.rt.rollout_nodes() if hasattr(self.rt, "rollout_nodes") else {}
        relays = manager.get("worker_relay", {})
        addresses = manager.get("relay_addresses", {})
        versions = manager.get("relay_versions", {})
        return {
            "job": getattr(self.rt, "job", None), "mode": self.cfg.mode, "finished": finished,
            "step": self.step, "total_steps": self.cfg.trainer.total_steps, "version": self.version,
            "rollouts": [{"id": w, "node": nodes.get(w), "relay": relays.get(w), "version": s.version,
                          "in_flight": s.num_in_flight, "kv_util": s.kv_utilization,
                          "generated_tokens": s.counters.generated_tokens}
                         for w, s in sorted(snaps.items())],
            "starting": manager.get("spawning", []), "dead": manager.get("dead", []),
            "relays": [{"id": r, "address": addresses.get(r), "latest": versions.get(r)}
                       for r in manager["chain"]],
            "relay_joins": manager.get("relay_joins", []),
            "pools": self.rt.pool_depths() if hasattr(self.rt, "pool_depths") else {},
        }

    def _live_state(self, snaps: dict[str, Any], manager: dict[str, Any]) -> Any:
        from laminar.live import LiveState, RolloutLine

        lines = []
        for w, s in sorted(snaps.items()):
            prev = self.last_counters.get(w)
            wall = max(1e-9, time.monotonic() - self.last_t)
            rate = (s.counters.generated_tokens - prev.generated_tokens) / wall if prev else 0.0
            state = "held" if s.held else "draining" if s.draining else "running" if s.num_in_flight else "idle"
            lines.append(RolloutLine(w, s.version, s.num_running, s.num_waiting, s.kv_utilization,
                                     rate, state))
        versions = manager.get("relay_versions", {})
        return LiveState(self.seen, lines, [(r, versions.get(r)) for r in manager["chain"]])

    def close(self) -> None:
        try:
            self._control(self.rt.manager_stats(), self.rt.snapshots(), finished=True)
        except Exception:  # the status file is a courtesy: never fail the end of a run on it
            pass
        self._records(self.rt.take_records(close=True))
        self.logger.close()
        self.view.__exit__(None, None, None)

    def _await_trainer(self) -> None:
        """Until the restarted trainer answers (a call made before would fail at once)."""
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        while True:
            try:
                self.rt.trainer_rows(0)
                return
            except TrainerRestarted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def follow(self, call: Callable[[], Any], started: Any = None, poll_s: float = 0.5) -> Any:
        """Run `call()` (it starts a trainer call; `started`: one already made) and log rows
        until it finishes; returns its value. If the trainer dies meanwhile, it restarts from
        its newest checkpoint and the call is made again; rollouts go on."""
        restarts = self.cfg.trainer.max_restarts
        pending = started if started is not None else call()
        while True:
            ready = self.rt.ready(pending, poll_s)
            try:
                self.poll()
            except TrainerRestarted:
                pass  # the call in flight says what happened
            if not ready:
                continue
            try:
                value = self.rt.result(pending)
            except TrainerRestarted:
                if restarts == 0:
                    raise
                restarts -= 1
                self.restarts += 1
                self.log_event("trainer_restart", "the trainer died; it restarts from its newest "
                               "checkpoint (rollouts go on)")
                self._await_trainer()
                self.seen = 0  # the restarted trainer keeps a fresh history
                pending = call()
                continue
            self.poll()
            return value


def _write_json(path: Any, value: Any) -> None:
    tmp = path.with_suffix(".tmp")  # atomic: a reader never sees half a file
    tmp.write_text(json.dumps(value, default=str))
    os.replace(tmp, path)


def finish(rt: Any, follower: Follower) -> dict[str, Any]:
    """The final held-out evaluation, then stop the loops and report where every leased prompt
    group ended up; the end-of-run line leads with the held-out score before -> after."""
    cfg = rt.cfg
    follower.final_eval()
    report = rt.finish()
    once = check_lineage(cfg.resolved_run_dir, cfg.rollout.group_size,
                         None if follower.step is None else follower.step * cfg.trainer.prompts_per_step)
    report["exactly_once"] = once.to_dict()
    acct = report["prompts"]  # every group handed out is trained, in flight or pending
    report["balance"] = {"issued": acct["issued"], "trained": acct["consumed"],
                         "in_flight": acct["leased"],
                         "pending": acct["returned"] + acct["completed"] - acct["consumed"],
                         "failed_trajectories": once.failed}
    if not once.ok:
        follower.log_event("exactly_once_failed", once.line())
    follower.close()
    first, last = reward_trend(read_metrics(cfg.resolved_run_dir))
    report |= {"reward_first": first, "reward_last": last}
    evals = read_rows(cfg.resolved_run_dir, "eval")
    heldout = ""
    if evals:  # the first asked, and the newest version's (evaluations may arrive out of order)
        a, b = evals[0], max(evals, key=lambda e: e["version"])
        report |= {"heldout_first": a, "heldout_last": b}
        heldout = (f"held-out greedy exact match {a['greedy_exact_match']:.2f} (version {a['version']}) "
                   f"-> {b['greedy_exact_match']:.2f} (version {b['version']}), sampled "
                   f"{a['sampled_exact_match']:.2f} -> {b['sampled_exact_match']:.2f}; ")
    (cfg.resolved_run_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    page = ""
    try:
        from laminar.report import load_run, run_report_html

        path = cfg.resolved_run_dir / "report.html"
        path.write_text(run_report_html([load_run(cfg.resolved_run_dir)]))
        page = f"; report {path}"
    except ImportError as e:  # matplotlib is in the `plots` extra (make installs it)
        page = f"; no report.html ({e.name} is missing: pip install 'laminar[plots]')"
    print(f"done: {heldout}mean training reward {first:.3f} (first steps) -> {last:.3f} (last "
          f"steps); groups trained {report['prompts']['consumed']}, repacks "
          f"{report['manager']['repacks']} ({cfg.resolved_run_dir}{page})", flush=True)
    print(once.line(), flush=True)
    return report


def _summed(counts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total
