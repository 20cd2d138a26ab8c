"""Where the pools keep their state: `RUN_DIR/pools.db` (SQLite, WAL), or memory for tests.

    store = open_store(run_dir / "pools.db")        # SqliteStore; MemoryStore() for a test
    store.put("leases", "e0-p3", {"index": 3, "owner": "rollout0", "state": "leased"})
    store.delete("partials", ["e0-p3/0"])
    store.commit()          # a durable point: everything written so far survives a kill -9
    store.maybe_commit()    # the batched path: commits when `commit_interval_s` has passed
    rows = store.load("leases")                     # key -> value, in first-write order

The interface is a handful of keyed tables of JSON values, so another backend (Redis, a
database server) replaces SQLite by implementing the same six methods. Each pool actor opens
its own connection to the one file; WAL lets them write one after another without blocking
readers. `synchronous=NORMAL`: a committed write survives the process (and the whole job)
being killed; it is not fsynced per commit, so it may not survive the machine losing power.

Which writes are durable points (commit at once) and which are batched is the pools' decision
(laminar/pools/*.py): a lease, a partial-pool registration, a buffer put and a trainer's sample
commit before they answer; streamed tokens and lease bookkeeping are batched.

Values are encoded with `encode_*` / `decode_*` below: plain JSON, readable with the `sqlite3`
shell (`SELECT key, value FROM kv WHERE tbl = 'groups'`).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from laminar.config import ConfigError
from laminar.types import GenerationRequest, PromptGroup, PromptItem, SamplingParams, Trajectory

SCHEMA = 1


DAMAGED = ("it is damaged or not ours: move it away to start the run's pools afresh (buffered and "
           "in-flight trajectories are then regenerated)")
OPEN_RETRIES_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # then one last try, whose error is the answer


class MemoryStore:
    """The same interface in memory: what a pool uses when nothing must survive (unit tests,
    `laminar bench`'s throwaway runs). Commits are no-ops; `load` returns what was put."""

    commit_interval_s = float("inf")  # batched writes never fall due: nothing to write
    last_commit = 0.0

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Any]] = {}
        self.commits = 0

    def put(self, table: str, key: str, value: Any) -> None:
        self.tables.setdefault(table, {})[key] = value

    def delete(self, table: str, keys: Iterable[str]) -> None:
        rows = self.tables.get(table, {})
        for key in keys:
            rows.pop(key, None)

    def load(self, table: str) -> dict[str, Any]:
        return json.loads(json.dumps(self.tables.get(table, {})))  # a copy, as a database returns

    def commit(self) -> None:
        self.commits += 1

    def maybe_commit(self) -> None:
        pass

    def close(self) -> None:
        pass


class SqliteStore:
    """One table `kv(tbl, key, value)`. Writes wait in memory (the last write of a key wins)
    until `commit()`, or a `maybe_commit()` after `commit_interval_s`, applies them in one
    short transaction: a connection never holds the write lock between calls, so the pools'
    connections (one per actor) never wait on each other for long."""

    def __init__(self, path: str | Path, commit_interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.commit_interval_s = commit_interval_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for wait in (*OPEN_RETRIES_S, None):
            try:
                self.db = self._open()
                break
            except sqlite3.OperationalError as e:
                # three pool actors open one new file at once: SQLite may answer "database is
                # locked" at once, without its busy timeout, to a connection that changes the
                # journal mode or reads the schema while another one does
                if wait is None or ("locked" not in str(e) and "busy" not in str(e)):
                    raise ConfigError(f"{self.path} is not a readable laminar pools database "
                                      f"({e}); {DAMAGED}") from None
                time.sleep(wait)
        self.pending: dict[tuple[str, str], str | None] = {}  # (table, key) -> JSON, None: delete
        self.last_commit = time.monotonic()
        self.commits = 0

    def _open(self) -> sqlite3.Connection:
        """A connection with the schema in place (an OperationalError closes it and goes up)."""
        db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None,
                             check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS kv (tbl TEXT NOT NULL, key TEXT NOT NULL, "
                       "value TEXT NOT NULL, PRIMARY KEY (tbl, key))")
            db.execute("CREATE TABLE IF NOT EXISTS schema (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema").fetchone()
            if row is None:
                db.execute("INSERT INTO schema VALUES (?)", (SCHEMA,))
            elif row[0] != SCHEMA:
                raise ConfigError(f"{self.path} has pool schema {row[0]}; this laminar reads "
                                  f"schema {SCHEMA}: resume it with the laminar that wrote it")
        except sqlite3.OperationalError:
            db.close()
            raise  # locked or busy: the caller retries
        except sqlite3.DatabaseError as e:
            db.close()
            raise ConfigError(f"{self.path} is not a readable laminar pools database ({e}); "
                              f"{DAMAGED}") from None
        except ConfigError:
            db.close()
            raise
        return db

    def put(self, table: str, key: str, value: Any) -> None:
        self.pending[(table, key)] = json.dumps(value)

    def delete(self, table: str, keys: Iterable[str]) -> None:
        for key in keys:
            self.pending[(table, key)] = None

    def load(self, table: str) -> dict[str, Any]:
        self.commit()
        try:
            rows = self.db.execute("SELECT key, value FROM kv WHERE tbl = ? ORDER BY rowid",
                                   (table,)).fetchall()
            return {key: json.loads(value) for key, value in rows}
        except (sqlite3.DatabaseError, json.JSONDecodeError) as e:
            raise ConfigError(f"{self.path}: table '{table}' cannot be read ({e}); the file is "
                              "damaged: move it away to start the run's pools afresh") from None

    def commit(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, {}
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.executemany(
                    "INSERT INTO kv (tbl, key, value) VALUES (?, ?, ?) ON CONFLICT (tbl, key) "
                    "DO UPDATE SET value = excluded.value",
                    [(t, k, v) for (t, k), v in pending.items() if v is not None])
                self.db.executemany("DELETE FROM kv WHERE tbl = ? AND key = ?",
                                    [(t, k) for (t, k), v in pending.items() if v is None])
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.commits += 1
        self.last_commit = time.monotonic()

    def maybe_commit(self) -> None:
        if self.pending and time.monotonic() - self.last_commit >= self.commit_interval_s:
            self.commit()

    def close(self) -> None:
        self.commit()
        self.db.close()


Store = MemoryStore | SqliteStore


def open_store(store: Store | str | Path | None, commit_interval_s: float = 0.5) -> Store:
    """A pool's store: a path (`RUN_DIR/pools.db`: a `SqliteStore`, opened in the calling
    process, so a pool actor passes the path and opens its own connection), a store as is, or
    a `MemoryStore` for None."""
    if store is None:
        return MemoryStore()
    if isinstance(store, (str, Path)):
        return SqliteStore(store, commit_interval_s)
    return store


# ---------------------------------------------------------------------------------------------
# Values


def _plain(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, lists copied (what `dataclasses.asdict` returns for
    these flat types, at a fraction of its cost: asdict deep-copies every list element, which
    for a trajectory's tokens and log-probs was most of a pool's Python time)."""
    return {f.name: (list(v) if isinstance(v := getattr(obj, f.name), list) else v)
            for f in fields(obj)}


def encode_group(group: PromptGroup) -> dict[str, Any]:
    d = _plain(group)
    d["item"] = _plain(group.item)
    return d


def decode_group(d: dict[str, Any]) -> PromptGroup:
    return PromptGroup(d["group_id"], PromptItem(**d["item"]), d["prompt_ids"], d["num_samples"])


def encode_request(req: GenerationRequest) -> dict[str, Any]:
    d = _plain(req)
    params = d["params"] = _plain(req.params)
    params["stop_token_ids"] = list(req.params.stop_token_ids)
    params["stop_sequences"] = [list(seq) for seq in req.params.stop_sequences]
    return d


def decode_request(d: dict[str, Any]) -> GenerationRequest:
    p = dict(d["params"])
    p["stop_token_ids"] = tuple(p["stop_token_ids"])
    p["stop_sequences"] = tuple(tuple(seq) for seq in p.get("stop_sequences", ()))
    return GenerationRequest(d["request_id"], d["prompt_ids"], SamplingParams(**p), d["output_ids"],
                             d["logprobs"], d["token_versions"], d["version"], d["finish_reason"])


def encode_trajectory(t: Trajectory) -> dict[str, Any]:
    return _plain(t)


def decode_trajectory(d: dict[str, Any]) -> Trajectory:
    return Trajectory(**d)
