"""Whole-job resume: the pools of a killed job made consistent, and the exactly-once check.

    summary = reconcile(store, checkpoint_version=6, rollout_version=6)   # before the pools start
    report = check_lineage(run_dir, group_size, steps)                   # at the end of every run

A job killed at a random moment (driver and every actor, SIGKILL) leaves `RUN_DIR/pools.db`
with each pool's last commit. The three pools commit separately, so their records can disagree
by a few moments; `reconcile` settles them, trusting the experience buffer first (its puts and
samples are durable points), then the partial pool, then the prompt pool:

- **trained vs requeued**: a group the trainer took at version v went into update v+1; the
  checkpoint the job resumes from (version c) holds it when v < c. Those stay trained; groups
  taken at v >= c go back to the front of the buffer (their gradient is not in the model).
- **buffered groups are reused**, not regenerated: complete and filling groups stay as they are.
- **in-flight trajectories**: a partial-pool entry whose sample is already in the buffer is
  dropped; the others continue from their streamed tokens when the weights that made them are
  the ones the rollouts start with (`rollout_version`: the checkpoint's), else they are
  regenerated from their prompt (every other version is gone with the killed relays). They are
  owned by `RESUMED` until the runtime hands them to live rollouts.
- **leases**: a group complete in the buffer is completed; one with samples in the buffer or
  the partial pool stays leased (by `RESUMED`, completed by whoever finishes it); one with
  nothing generated goes back to the queue and is issued again first.

`check_lineage` reads the trainer's audit (`RUN_DIR/trajectories.jsonl`, one line per trained
trajectory plus a mark at every restart or resume) and verifies the invariant: every group's
gradient is in the final model exactly once.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from laminar.pools.store import Store

RESUMED = "resumed"  # owner of the killed job's unfinished work until a live rollout takes it


@dataclass
class ResumeSummary:
    checkpoint_version: int | None  # the model resumes from this version (None: its start)
    trained_groups: int = 0  # in the checkpoint: never trained again
    requeued_groups: int = 0  # taken after the checkpoint: back in the buffer, trained again
    ready_groups: int = 0  # complete in the buffer, untrained (reused, requeued included)
    filling_groups: int = 0  # some samples in the buffer (reused), the rest in flight
    continued: int = 0  # in-flight trajectories that go on from their streamed tokens
    regenerated: int = 0  # in-flight trajectories started again (their version is gone)
    not_started: int = 0  # in-flight trajectories with no tokens on record yet
    dropped: int = 0  # partial entries already in the buffer
    returned_groups: int = 0  # leased, nothing generated: issued again
    position: dict[str, int] = field(default_factory=dict)  # the prompt sampler's

    def line(self) -> str:
        at = "its start" if self.checkpoint_version is None else f"version {self.checkpoint_version}"
        return (f"model from {at}; {self.trained_groups} groups already trained, "
                f"{self.requeued_groups} trained after the checkpoint go back to the buffer; "
                f"{self.ready_groups} complete and {self.filling_groups} filling groups reused; "
                f"{self.continued} in-flight trajectories continue from their tokens, "
                f"{self.regenerated} regenerated, {self.not_started} not started; "
                f"{self.returned_groups} leased groups issued again; prompts at epoch {self.position.get('epoch', 0)} position "
                f"{self.position.get('position', 0)}")


def reconcile(store: Store, checkpoint_version: int | None, rollout_version: int,
              mixes_versions: bool = False) -> ResumeSummary:
    """Make the stored pools of a killed job consistent for a resume from the checkpoint at
    `checkpoint_version`, with rollouts starting on `rollout_version`. `mixes_versions` (the
    partial-rollout schedule): a trajectory's tokens of any version go on (each keeps the
    version and log-prob that made it, as after any swap). Writes and commits."""
    summary = ResumeSummary(checkpoint_version)
    groups = store.load("groups")
    trajs = store.load("trajectories")
    for gid, row in groups.items():
        if row["state"] == "taken":
            if checkpoint_version is not None and row["step"] < checkpoint_version:
                row["state"] = "trained"
                store.delete("trajectories", [t for t, v in trajs.items() if v["group_id"] == gid])
            else:
                row["state"] = "ready"
                summary.requeued_groups += 1
            row["step"] = None if row["state"] == "ready" else row["step"]
            store.put("groups", gid, row)
        summary.trained_groups += row["state"] == "trained"
        summary.ready_groups += row["state"] == "ready"
    trajs = {t: v for t, v in trajs.items() if groups.get(v["group_id"], {}).get("state") != "trained"}
    filling = {v["group_id"] for v in trajs.values()} - set(groups)
    summary.filling_groups = len(filling)

    live = set(filling)
    partials = store.load("partials")
    for tid, row in partials.items():
        if tid in trajs or row["group"]["group_id"] in groups:
            store.delete("partials", [tid])
            summary.dropped += 1
            continue
        req = row["request"]
        versions = set(req["token_versions"])
        if versions and versions != {rollout_version} and not mixes_versions:  # weights gone
            req.update(output_ids=[], logprobs=[], token_versions=[], version=None)
            summary.regenerated += 1
        elif versions:
            summary.continued += 1
        else:
            summary.not_started += 1
        row["owner"] = RESUMED
        store.put("partials", tid, row)
        live.add(row["group"]["group_id"])

    for gid, row in store.load("leases").items():
        if row["state"] == "completed":
            continue
        if gid in groups:
            row["state"] = "completed"
        elif row["state"] == "leased" and gid in live:
            row["owner"] = RESUMED
        elif row["state"] == "leased":
            row.update(state="returned", owner=None)
            summary.returned_groups += 1
        store.put("leases", gid, row)

    meta = store.load("meta").get("prompts")
    if meta is not None:
        meta["consumed"] = summary.trained_groups
        store.put("meta", "prompts", meta)
        summary.position = {k: meta["sampler"][k] for k in ("epoch", "position")}
    store.commit()
    return summary


# ---------------------------------------------------------------------------------------------
# The invariant


@dataclass
class LineageReport:
    groups: int  # groups whose gradient is in the final model
    trajectories: int
    duplicates: list[str]  # trajectory ids trained more than once in the lineage
    incomplete: list[str]  # groups with fewer samples than group_size in the lineage
    restarts: int  # trainer restarts and job resumes
    expected_groups: int | None  # steps x prompts_per_step, when known
    failed: int = 0  # trajectories in the lineage whose reward failed (left out of their update)

    @property
    def ok(self) -> bool:
        return (not self.duplicates and not self.incomplete
                and (self.expected_groups is None or self.groups == self.expected_groups))

    def line(self) -> str:
        if self.ok:
            return (f"exactly-once check: passed; {self.groups} groups ({self.trajectories} "
                    f"trajectories) are in the final model once each, across "
                    f"{self.restarts} restart(s)")
        problems = []
        if self.duplicates:
            problems.append(f"{len(self.duplicates)} trajectories trained twice (e.g. {self.duplicates[:3]})")
        if self.incomplete:
            problems.append(f"{len(self.incomplete)} groups incomplete (e.g. {self.incomplete[:3]})")
        if self.expected_groups is not None and self.groups != self.expected_groups:
            problems.append(f"{self.groups} groups trained, {self.expected_groups} expected")
        return "exactly-once check: FAILED: " + "; ".join(problems)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def lineage(lines: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The audit lines whose gradient is in the final model: at every restart or resume mark,
    the lines trained after the checkpoint it resumed from (trained_at >= resumed_at) are
    cut. Returns (kept lines, number of marks)."""
    kept: list[dict[str, Any]] = []
    marks = 0
    for line in lines:
        if "event" in line:
            marks += 1
            resumed = line.get("resumed_at")
            kept = [t for t in kept if resumed is not None and t["trained_at"] < resumed]
        elif "traj_id" in line:
            kept.append(line)
    return kept, marks


def read_audit(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for raw in path.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            continue  # a line torn by a kill
    return out


def check_lineage(run_dir: str | Path, group_size: int, expected_groups: int | None = None) -> LineageReport:
    kept, marks = lineage(read_audit(Path(run_dir) / "trajectories.jsonl"))
    per_traj = Counter(t["traj_id"] for t in kept)
    per_group = Counter(t["group_id"] for t in {t["traj_id"]: t for t in kept}.values())
    return LineageReport(
        groups=len(per_group), trajectories=len(per_traj),
        duplicates=sorted(t for t, n in per_traj.items() if n > 1),
        incomplete=sorted(g for g, n in per_group.items() if n != group_size),
        restarts=marks, expected_groups=expected_groups,
        failed=sum(1 for t in kept if t.get("failed")))


# ---------------------------------------------------------------------------------------------
# The run directory


def prepare_pools(cfg: Any, checkpoint_version: int | None, rollout_version: int,
                  mixes_versions: bool = False) -> tuple[str | None, ResumeSummary | None]:
    """Where the pools of this run live (None: in memory) and, when resuming, what the
    reconciliation did. A fresh run sets an earlier run's pools, checkpoints and published
    version aside (name.<time>), so nothing of it is resumed or restarted from by mistake."""
    from laminar.metrics import set_aside
    from laminar.pools.store import SqliteStore

    run_dir = cfg.resolved_run_dir
    path = run_dir / "pools.db"
    if not cfg.resume:
        for name in ("checkpoints", "trainer_published.json"):
            set_aside(run_dir / name)
        if path.exists():
            stamp = _stamp(path)
            print(f"note: {run_dir} held an earlier run; its pools and checkpoints are set aside "
                  f"(pools.{stamp}.db, checkpoints.<time>). To continue a run instead: "
                  f"laminar resume {run_dir}", flush=True)
            for suffix in ("", "-wal", "-shm"):
                old = run_dir / f"pools.db{suffix}"
                if old.exists():
                    old.rename(run_dir / f"pools.{stamp}.db{suffix}")
        return (str(path) if cfg.durable_pools else None), None
    store = SqliteStore(path)  # check_resumable (start_weights) has vetted it
    try:
        summary = reconcile(store, checkpoint_version, rollout_version, mixes_versions)
    finally:
        store.close()
    return str(path), summary


def _stamp(path: Path) -> str:
    import time

    return time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))


def check_resumable(cfg: Any) -> None:
    """Before anything starts: the run directory has what a resume needs, readable, or a
    ConfigError says what is wrong and what to do (no traceback from deep in a component)."""
    from laminar.config import ConfigError
    from laminar.pools.store import SqliteStore
    from laminar.trainer.service import newest_checkpoint

    run_dir = cfg.resolved_run_dir
    if not run_dir.is_dir():
        raise ConfigError(f"nothing to resume: {run_dir} does not exist (run_dir / name)")
    if not cfg.durable_pools:
        raise ConfigError("resume=true needs durable_pools=true: the pools of a run kept in memory "
                          "died with it (its checkpoints can still start a new run: "
                          "trainer.from_checkpoint=RUN_DIR/checkpoints/step_NNNNNN)")
    if not (run_dir / "pools.db").exists():
        raise ConfigError(f"nothing to resume in {run_dir}: it has no pools.db (was the run "
                          "started with durable_pools=false, or is this the wrong directory?)")
    store = SqliteStore(run_dir / "pools.db")  # a file that is not ours fails here
    try:
        problem = store.db.execute("PRAGMA quick_check").fetchone()[0]
    finally:
        store.close()
    if problem != "ok":
        raise ConfigError(f"{run_dir / 'pools.db'} is damaged ({problem}): move it away to start "
                          "the run's pools afresh (buffered and in-flight work is then regenerated)")
    ckpt = newest_checkpoint(run_dir)
    if ckpt is None:
        return  # killed before its first checkpoint: the model starts over, the data is kept
    problem = checkpoint_problem(ckpt)
    if problem:
        older = [p.name for p in sorted((run_dir / "checkpoints").glob("step_*"))
                 if p != ckpt and not p.name.endswith(".tmp")]
        raise ConfigError(f"the newest checkpoint {ckpt} is damaged ({problem}); move it out of "
                          f"{run_dir / 'checkpoints'} and resume again"
                          + (f": the job then resumes from {older[-1]}" if older else
                             ": the job then resumes from its starting weights"))


def checkpoint_problem(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint directory, or None when it looks whole."""
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        int(state["version"])
    except (OSError, ValueError, KeyError) as e:
        return f"trainer_state.json: {e}"
    for name in ("rng.pt", "model/config.json"):
        if not (ckpt / name).is_file():
            return f"{name} is missing"
    if not ((ckpt / "dcp" / ".metadata").is_file() or (ckpt / "optimizer.pt").is_file()):
        return "dcp/.metadata is missing"  # the sharded model and optimizer (optimizer.pt before DCP)
    weights = sorted((ckpt / "model").glob("*.safetensors"))
    if not weights:
        return "model/*.safetensors is missing"
    try:
        from safetensors import safe_open

        for w in weights:
            with safe_open(w, framework="pt") as f:
                f.keys()
    except Exception as e:  # a truncated or overwritten file: any reader error means damaged
        return f"{weights[0].name} cannot be read: {e}"
    return None


def deal_resumed(entries: list[Any], ids: list[str], started: bool | None = None) -> dict[str, list[Any]]:
    """The killed job's in-flight trajectories (partial-pool entries owned by `RESUMED`), dealt
    out evenly over the rollouts `ids` as `Unfinished` moves; `started`: only those with (True)
    or without (False) streamed tokens."""
    from laminar.types import Unfinished

    if started is not None:
        entries = [e for e in entries if bool(e.request.output_ids) == started]
    return {wid: [Unfinished(e.request, e.group) for e in entries[i::len(ids)]]
            for i, wid in enumerate(ids) if entries[i::len(ids)]}


def claim_run_dir(run_dir: Path, job: str, shm_dir: str) -> None:
    """RUN_DIR/job.json names the job using the run directory. A job killed with SIGKILL never
    removed its relays' shared memory: the next job in the directory does. A directory whose
    job's driver still runs is refused."""
    import os

    from laminar.config import ConfigError
    from laminar.relay.relay import segment_prefix

    path = run_dir / "job.json"
    if path.exists():
        n = 0
        try:
            old = json.loads(path.read_text())
            if old.get("pid") != os.getpid() and _alive(old.get("pid")):
                raise ConfigError(f"{run_dir} is in use by a running job (driver pid {old['pid']}); "
                                  "stop it first, or set run_dir (or name) to another directory")
            for seg in Path(old["shm_dir"]).glob(segment_prefix(old["job"], "*") + ".*"):
                seg.unlink(missing_ok=True)
                n += 1
        except (ValueError, KeyError, OSError):
            pass
        if n:
            print(f"removed {n} shared-memory files the killed job {old['job']} left in "
                  f"{old['shm_dir']}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"job": job, "shm_dir": shm_dir, "pid": os.getpid()}))


def _alive(pid: int | None) -> bool:
    """A laminar driver with this process id is running (not a recycled id)."""
    import psutil

    try:
        return pid is not None and "laminar" in " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return False
