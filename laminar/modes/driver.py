"""What every schedule's driver shares: the `Follower`, which follows the trainer while the
observers of laminar/observe/ log the run's rows (laminar/metrics.py: trainer steps joined with
what the rollouts did meanwhile, held-out evaluations, timeline spans, events) and keep the
operators' files, and `finish`, the final accounting. Talks to the runtime only through its
driver API (laminar/runtime/api.py), so it runs on either backend."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import yaml

from laminar.live import LiveView
from laminar.metrics import MetricsLogger, read_metrics, read_rows, reward_trend
from laminar.modes.common import start_step
from laminar.observe.activity import RolloutActivity
from laminar.observe.eval_schedule import EvalSchedule
from laminar.observe.events import ManagerEvents
from laminar.observe.operators import OperatorFiles
from laminar.pools.resume import check_lineage
from laminar.runtime import Runtime, TrainerRestarted
from laminar.runtime.api import Pending
from laminar.sinks import open_sinks


class Follower:
    """Follows a trainer call (`follow`) and, every poll, turns trainer rows into metrics rows
    with what the rollouts did meanwhile (observe/activity.py), logs the manager's events
    (observe/events.py), runs the held-out evaluation schedule (observe/eval_schedule.py),
    keeps the operators' files and answers `laminar scale` (observe/operators.py), and draws
    the live view."""

    def __init__(self, rt: Runtime) -> None:
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
        self.seen = 0  # trainer rows logged (of the trainer's current history)
        self.version = rt.start_version  # of the newest trainer row logged
        self.step: int | None = None  # its update count (trainer.total_steps counts those)
        self.restarts = 0  # trainer restarts seen
        self.activity = RolloutActivity()
        self.events = ManagerEvents(rt.manager_stats())  # events are what changes
        self.evals = EvalSchedule(rt)
        self.operators = OperatorFiles(rt, self.log_event)
        if cfg.resume:
            summary = rt.resumed
            self.log_event("resume", f"the job resumed in {run_dir}: " + (
                summary.line() if summary else f"model from version {rt.start_version}"))
        elif cfg.trainer.from_checkpoint:
            self.log_event("resume", f"resumed from {cfg.trainer.from_checkpoint} at version {rt.start_version}")
        self.evals.ask(step=start_step(cfg), at_least=rt.start_version)

    # ------------------------------------------------------------------------- the run loop

    def follow(self, call: Callable[[], Pending], started: Pending | None = None,
               poll_s: float = 0.5) -> Any:
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
                self._trainer_restarted()
                pending = call()
                continue
            self.poll()
            return value

    def poll(self) -> int:
        """Log what arrived since the last poll; returns how many trainer rows."""
        rows = self.rt.trainer_rows(self.seen)
        snaps = self.rt.snapshots()
        self.activity.sample(snaps)
        self._records(self.rt.take_records())
        manager = self.rt.manager_stats()
        for what, detail in self.events.update(manager):
            self.log_event(what, detail)
        self.operators.publish(manager, self.restarts)
        self.operators.control(manager, snaps, self.step, self.version)
        for eval_id, wid in self.evals.reassign(manager["workers"]):
            self.log_event("eval_moved", f"held-out evaluation {eval_id} moved from {wid}")
        self.view.update(self.activity.live_state(snaps, manager, self.seen))
        if rows:
            self._log_trainer_rows(rows, self.activity.row_fields(snaps, manager))
        self.evals.on_clock(self.step or 0, self.version)
        return len(rows)

    def final_eval(self) -> None:
        """The held-out score of the last version; waits for it (and any still running)."""
        self.evals.ask(step=self.step if self.step is not None else start_step(self.cfg),
                       at_least=self.version)
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        while self.evals.missing() and time.monotonic() < deadline:
            self.rt.idle(0.2)
            self.poll()
        missing = self.evals.missing()
        if missing:
            self.log_event("eval_missing", f"held-out evaluations {missing} never reported "
                           "(their rollout died or retired)")

    def close(self) -> None:
        try:
            self.operators.control(self.rt.manager_stats(), self.rt.snapshots(), self.step,
                                   self.version, finished=True)
        except Exception:  # the status file is a courtesy: never fail the end of a run on it
            pass
        self._records(self.rt.take_records(close=True))
        self.logger.close()
        self.view.__exit__(None, None, None)

    # ------------------------------------------------------------------------- rows

    def log_event(self, what: str, detail: str) -> None:
        self.view.row(self.logger.write("event", {"what": what, "detail": detail}))

    def _log_trainer_rows(self, rows: list[dict[str, Any]], fields: dict[str, Any]) -> None:
        """A `step` row per trainer row (with what the rollouts did meanwhile) and the trainer's
        spans; an evaluation every trainer.eval_every updates."""
        for row in rows:
            spans = row.pop("spans", [])
            published = row.pop("published_at", None)  # the update's own time, not this poll's
            row = {**row, **fields, "mode": self.cfg.mode}
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
            self.evals.after_step(self.step, row["version"])
        self.seen += len(rows)

    def _records(self, records: dict[str, dict[str, Any]]) -> None:
        for w, rec in records.items():
            for result in rec["evals"]:
                self.evals.reported(result)
                self.view.row(self.logger.write("eval", {**result, "rollout": w}))
            for span in rec["spans"]:
                self.logger.write("span", {"who": w, "what": span.what, "version": span.version,
                                           "start": self.logger.since_start(span.start),
                                           "end": self.logger.since_start(span.end)})
            self.activity.add_records(rec)

    def _trainer_restarted(self) -> None:
        """Log it, wait until the restarted trainer answers (a call made before would fail at
        once); it keeps a fresh history of rows."""
        self.restarts += 1
        self.log_event("trainer_restart", "the trainer died; it restarts from its newest "
                       "checkpoint (rollouts go on)")
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        while True:
            try:
                self.rt.trainer_rows(0)
                break
            except TrainerRestarted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.seen = 0  # the restarted trainer keeps a fresh history


def resume_global_batches(rt: Runtime, follower: Follower, step: int) -> tuple[int, int]:
    """A global-batch schedule (sync, one_step, stream) resuming a killed job: first train the
    complete batches the buffer already holds (requeued ones: taken after the checkpoint),
    syncing the rollouts to each new version, as the lost lineage did; then hand the job's
    not-yet-started trajectories to the rollouts, so each is generated by the weights its
    batch had before the kill (those with tokens, all of the checkpoint's version, go on at
    once, with it). Returns (updates so far, groups of the next batch already
    leased or done: the driver generates only the rest). Not resuming: (step, 0)."""
    if not rt.cfg.resume:
        return step, 0
    B, total = rt.cfg.trainer.prompts_per_step, rt.cfg.trainer.total_steps
    rt.hand_out_resumed(started=True)  # tokens of the checkpoint's version: go on with it now
    while step < total and rt.ready_groups() >= B:
        row = follower.follow(lambda: rt.train("train_once"))
        step = row["step"]
        rt.sync_weights(row["version"])
    rt.hand_out_resumed()
    return step, rt.untrained_groups()


def finish(rt: Runtime, follower: Follower) -> dict[str, Any]:
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
        from laminar.report import load_run, run_report_html  # matplotlib (the `plots` extra)

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

