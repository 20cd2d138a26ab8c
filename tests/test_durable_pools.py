"""Durable pools: RUN_DIR/pools.db written through, read back by a fresh process, reconciled
after a whole-job kill, and the exactly-once lineage check."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from laminar.config import ConfigError
from laminar.pools.experience import ExperienceBuffer
from laminar.pools.partials import PartialPool
from laminar.pools.prompts import PromptPool, PromptSampler
from laminar.pools.resume import RESUMED, check_lineage, lineage, reconcile
from laminar.pools.store import MemoryStore, SqliteStore
from laminar.rollout.requests import group_requests
from laminar.types import PromptItem, SamplingParams, TokenDelta, Trajectory

ITEMS = [PromptItem(i, f"p{i}=", f"a{i}") for i in range(6)]


def encode(text):
    return [1] + [ord(c) % 100 for c in text]


def traj(gid, i, version=0):
    return Trajectory(f"{gid}/{i}", gid, [1, 2], [3, 4], [-0.1, -0.2], version, reward=float(i))


def pools(db, restore=False):
    return (PromptPool(PromptSampler(ITEMS, encode, 2, seed=0), 60, None, str(db), restore),
            PartialPool(str(db), restore), ExperienceBuffer(2, store=str(db), restore=restore))


def test_sqlite_store_commits_survive_and_uncommitted_writes_do_not(tmp_path):
    db = tmp_path / "pools.db"
    store = SqliteStore(db, commit_interval_s=3600)
    store.put("t", "a", {"x": 1})
    store.commit()
    store.put("t", "b", {"x": 2})  # batched, never committed
    store.maybe_commit()  # the interval has not passed
    other = SqliteStore(db)  # another process's view
    assert other.load("t") == {"a": {"x": 1}}
    store.delete("t", ["a"])
    store.commit()
    assert other.load("t") == {"b": {"x": 2}}
    assert other.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_killed_writer_loses_only_what_it_had_not_committed(tmp_path):
    db = tmp_path / "pools.db"
    code = textwrap.dedent(f"""
        import os, signal, time
        from laminar.pools.store import SqliteStore
        s = SqliteStore({str(db)!r}, commit_interval_s=3600)
        s.put("t", "durable", 1); s.commit()
        s.put("t", "pending", 2)
        print("ready", flush=True)
        time.sleep(3600)  # until the kill
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert SqliteStore(db).load("t") == {"durable": 1}


def test_opening_retries_a_locked_database_and_names_anything_else(tmp_path, monkeypatch):
    """SQLite may answer "database is locked" at once (no busy timeout) to one of the three
    pools opening a new pools.db together: the store tries again; any other OperationalError,
    or a lock that outlasts the retries, is the one-line ConfigError."""
    import laminar.pools.store as store

    monkeypatch.setattr(store, "OPEN_RETRIES_S", (0.0, 0.0))
    real, tries = SqliteStore._open, []

    def flaky(self):
        tries.append(1)
        if len(tries) < 3:
            raise sqlite3.OperationalError("database is locked")
        return real(self)

    monkeypatch.setattr(SqliteStore, "_open", flaky)
    SqliteStore(tmp_path / "a.db").close()
    assert len(tries) == 3
    tries.clear()
    monkeypatch.setattr(SqliteStore, "_open", lambda self: (_ for _ in ()).throw(
        sqlite3.OperationalError("database is locked")))
    with pytest.raises(ConfigError, match="database is locked.*move it away"):
        SqliteStore(tmp_path / "b.db")
    monkeypatch.setattr(SqliteStore, "_open", lambda self: (_ for _ in ()).throw(
        sqlite3.OperationalError("disk I/O error")))
    with pytest.raises(ConfigError, match="disk I/O error"):
        SqliteStore(tmp_path / "c.db")


_OPEN_TOGETHER = """
import sys, time
from laminar.pools.store import SqliteStore
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
s = SqliteStore(sys.argv[1]); s.put("t", sys.argv[3], 1); s.commit(); s.close()
"""


def test_three_processes_open_a_new_pools_db_at_once(tmp_path):
    """As the three pool actors of a job do: real processes, one new file, the same instant."""
    import time

    for round_ in range(2):
        db = tmp_path / f"pools{round_}.db"
        at = str(time.time() + 1.0)
        procs = [subprocess.Popen([sys.executable, "-c", _OPEN_TOGETHER, str(db), at, str(k)])
                 for k in range(3)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
        assert set(SqliteStore(db).load("t")) == {"0", "1", "2"}


def test_a_damaged_pools_db_is_a_clear_error(tmp_path):
    db = tmp_path / "pools.db"
    db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConfigError, match="pools.db is not a readable laminar pools database"):
        SqliteStore(db)


def test_pools_restore_from_the_database_as_they_were(tmp_path):
    db = tmp_path / "pools.db"
    prompts, partials, buffer = pools(db)
    groups = prompts.lease("rollout0", 3, now=0.0)
    params = SamplingParams(max_new_tokens=8)
    partials.register_many("rollout0", [(g, group_requests(g, params)) for g in groups])
    tid = f"{groups[1].group_id}/0"
    partials.update("rollout0", [TokenDelta(tid, [5, 6], [-0.5, -0.6], token_versions=[0, 0])])
    partials.flush()
    assert buffer.put_many([traj(groups[0].group_id, 0), traj(groups[0].group_id, 1),
                            traj(groups[2].group_id, 0)]) == [groups[0].group_id]
    prompts.complete(groups[0].group_id)
    prompts.flush()
    assert buffer.sample(1, trainer_version=4)[0][0].group_id == groups[0].group_id

    p2, q2, b2 = pools(db, restore=True)  # a fresh process reads the same file
    assert p2.sampler.state_dict() == prompts.sampler.state_dict()
    assert p2.accounting() == prompts.accounting()
    assert set(p2.leases) == {groups[1].group_id, groups[2].group_id}
    assert q2.entries[tid].request.output_ids == [5, 6]
    assert q2.entries[tid].request.params == partials.entries[tid].request.params  # its seed too
    assert q2.entries[tid].group == groups[1]
    assert b2.taken[groups[0].group_id][1] == 4 and list(b2.filling) == [groups[2].group_id]
    assert b2.put(traj(groups[2].group_id, 0)) is False  # still a duplicate after the restart


def test_rewind_gives_back_exactly_what_the_checkpoint_lacks():
    buffer = ExperienceBuffer(1)
    for g in ["a", "b", "c", "d"]:
        buffer.put_many([traj(g, 0)])
    buffer.sample(1, trainer_version=0)  # a -> update 1
    buffer.sample(1, trainer_version=1)  # b -> update 2
    buffer.sample(1, trainer_version=2)  # c -> update 3
    assert buffer.rewind(2) == 1  # the checkpoint at 2 holds a and b; c goes back
    assert [g[0].group_id for g in buffer.complete] == ["c", "d"]
    assert buffer.trained == {"a", "b"}
    assert buffer.put(traj("a", 0)) is False  # a trained group's late put is a duplicate
    buffer.sample(2, trainer_version=5)
    assert buffer.rewind(None) == 2  # no checkpoint: everything taken goes back, in order
    assert [g[0].group_id for g in buffer.complete] == ["c", "d"]


def test_reconcile_after_a_kill(tmp_path):
    db = tmp_path / "pools.db"
    prompts, partials, buffer = pools(db)
    g = prompts.lease("rollout0", 5, now=0.0)
    params = SamplingParams(max_new_tokens=8)
    partials.register_many("rollout0", [(x, group_requests(x, params)) for x in g[:4]])
    # g0: trained in update 1 (before the checkpoint at version 1); g1: taken for update 2
    for x in g[:2]:
        buffer.put_many([traj(x.group_id, 0), traj(x.group_id, 1)])
    buffer.sample(1, trainer_version=0)
    buffer.sample(1, trainer_version=1)
    # g2: one sample in the buffer, the other streamed 2 tokens by version 1 (gone after the kill)
    buffer.put_many([traj(g[2].group_id, 0)])
    partials.update("rollout0", [TokenDelta(f"{g[2].group_id}/1", [7, 7], [-1.0, -1.0], token_versions=[1, 1])])
    # g3: both in flight with version 0 (the checkpoint's weights: they continue)
    partials.update("rollout0", [TokenDelta(f"{g[3].group_id}/0", [9], [-1.0], token_versions=[0])])
    partials.flush()
    prompts.flush()  # g4 leased, nothing generated

    summary = reconcile(SqliteStore(db), checkpoint_version=1, rollout_version=0)
    assert (summary.trained_groups, summary.requeued_groups, summary.ready_groups) == (1, 1, 1)
    assert (summary.filling_groups, summary.returned_groups) == (1, 1)
    # g2/0 in the buffer is dropped, g2/1 regenerated, g3/0 continues (g3/1 had no tokens yet);
    # g0's and g1's entries are dropped
    assert (summary.continued, summary.regenerated, summary.not_started, summary.dropped) == (1, 1, 1, 5)
    p2, q2, b2 = pools(db, restore=True)
    assert [x[0].group_id for x in b2.complete] == [g[1].group_id]  # requeued, not regenerated
    assert b2.trained == {g[0].group_id}
    assert {e.owner for e in q2.entries.values()} == {RESUMED}
    assert q2.entries[f"{g[2].group_id}/1"].request.output_ids == []
    assert q2.entries[f"{g[3].group_id}/0"].request.output_ids == [9]
    assert [x.group_id for x in p2.returned] == [g[4].group_id]
    assert p2.consumed == 1
    assert p2.lease("rollout1", 1, now=0.0)[0].group_id == g[4].group_id  # issued again first
    acct = p2.accounting()
    assert acct["issued"] == acct["leased"] + acct["returned"] + acct["completed"]


def test_lineage_cuts_what_a_restart_lost(tmp_path):
    lines = [{"traj_id": f"g{i}/0", "group_id": f"g{i}", "trained_at": i} for i in range(4)]
    lines.append({"event": "trainer_restart", "resumed_at": 2, "continues_at": 4})
    lines += [{"traj_id": "g2/0", "group_id": "g2", "trained_at": 4},
              {"traj_id": "g3/0", "group_id": "g3", "trained_at": 5}]
    kept, marks = lineage(lines)
    assert [t["traj_id"] for t in kept] == ["g0/0", "g1/0", "g2/0", "g3/0"] and marks == 1
    (tmp_path / "trajectories.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert check_lineage(tmp_path, 1, expected_groups=4).ok
    bad = lines + [{"traj_id": "g1/0", "group_id": "g1", "trained_at": 6}]
    (tmp_path / "trajectories.jsonl").write_text("\n".join(json.dumps(x) for x in bad) + "\n")
    report = check_lineage(tmp_path, 1)
    assert report.duplicates == ["g1/0"] and "FAILED" in report.line()


def test_memory_store_is_the_same_interface():
    store = MemoryStore()
    buffer = ExperienceBuffer(1, store=store)
    buffer.put_many([traj("a", 0)])
    assert set(store.load("trajectories")) == {"a/0"} and store.load("groups")["a"]["state"] == "ready"
    assert ExperienceBuffer(1, store=store, restore=True).num_ready() == 1


def test_the_database_reads_with_the_sqlite_shell_schema(tmp_path):
    db = tmp_path / "pools.db"
    buffer = ExperienceBuffer(1, store=str(db))
    buffer.put_many([traj("a", 0)])
    rows = sqlite3.connect(db).execute("SELECT key, value FROM kv WHERE tbl = 'groups'").fetchall()
    assert rows[0][0] == "a" and json.loads(rows[0][1])["state"] == "ready"


def _laminar(*args):
    return subprocess.run([sys.executable, "-m", "laminar.cli", *args], capture_output=True,
                          text=True, timeout=120)


def _run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"run_dir: {run}\nsft: {{enabled: false}}\n")
    return run


def test_resume_refuses_a_damaged_pools_db_in_one_line(tmp_path):
    run = _run_dir(tmp_path)
    (run / "pools.db").write_bytes(b"garbage" * 1000)
    done = _laminar("resume", str(run))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pools.db is not a readable laminar pools database" in done.stderr
    assert "move it away" in done.stderr


def test_resume_refuses_a_damaged_checkpoint_and_names_the_one_before(tmp_path):
    run = _run_dir(tmp_path)
    SqliteStore(run / "pools.db").close()
    for v in (3, 6):
        ckpt = run / "checkpoints" / f"step_{v:06d}"
        (ckpt / "model").mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"version": v, "steps": v}))
        for name in ("optimizer.pt", "rng.pt", "model/config.json"):
            (ckpt / name).write_text("{}")
        (ckpt / "model" / "model.safetensors").write_bytes(b"\x10\x00")  # cut short by a disk
    done = _laminar("resume", str(run))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "step_000006 is damaged" in done.stderr and "resumes from step_000003" in done.stderr


def test_resume_needs_a_run_directory(tmp_path):
    done = _laminar("resume", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "has no config.yaml" in done.stderr
    run = _run_dir(tmp_path)
    done = _laminar("resume", str(run))
    assert done.returncode == 2 and "it has no pools.db" in done.stderr


def test_reconcile_keeps_mixed_version_tokens_for_partial_rollout(tmp_path):
    db = tmp_path / "pools.db"
    prompts, partials, _ = pools(db)
    g = prompts.lease("rollout0", 1, now=0.0)[0]
    partials.register_many("rollout0", [(g, group_requests(g, SamplingParams(max_new_tokens=8)))])
    partials.update("rollout0", [TokenDelta(f"{g.group_id}/0", [7, 8], [-1.0, -1.0], token_versions=[3, 4])])
    partials.flush()
    summary = reconcile(SqliteStore(db), checkpoint_version=2, rollout_version=2, mixes_versions=True)
    assert (summary.continued, summary.regenerated) == (1, 0)
    entry = PartialPool(str(db), restore=True).entries[f"{g.group_id}/0"]
    assert entry.request.output_ids == [7, 8] and entry.request.token_versions == [3, 4]
