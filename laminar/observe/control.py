"""The control channel of a running job: RUN_DIR/control/ and RUN_DIR/status.json.

    laminar scale RUN_DIR --add 2 [--new-node]   # submit(): a request file, then wait for its reply
    laminar scale RUN_DIR --remove rollout3
    laminar scale RUN_DIR --rollouts 6
    laminar status RUN_DIR                        # read_status(): what the driver last wrote

Why files and not a named Ray actor: the driver already owns RUN_DIR and polls every fraction of
a second, so a request file is picked up without another process joining the job's Ray cluster
(an embedded cluster has no address a second process could know; on a real cluster the command
would need Ray, the job's namespace and the cluster's address); a request and its reply stay on
disk as a record of who changed what; and the same two commands work on every backend, a
stopped job included (`status` then says when it last ran).

A request is `control/req-<time>-<rand>.json`, written whole and renamed into place (the driver
never sees half a file); the driver answers with `control/rep-<time>-<rand>.json` and renames
the request to `req-<time>-<rand>.done`. The driver rewrites `status.json` (rollouts, relays, versions, pools)
at most once a second.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from laminar.config import ConfigError

STATUS_EVERY_S = 1.0
STALE_S = 15.0  # a status older than this: the job is not running (or not polling)


def _atomic_write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- driver side


def write_status(run_dir: Path, status: dict[str, Any]) -> None:
    _atomic_write(run_dir / "status.json", {**status, "updated_at": time.time(), "pid": os.getpid()})


def pending_requests(run_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Requests not answered yet, oldest first; a file that is not valid JSON is answered with
    an error at once (and so never blocks the others)."""
    folder = run_dir / "control"
    out = []
    for path in sorted(folder.glob("req-*.json")) if folder.is_dir() else []:
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            answer(path, {"ok": False, "message": f"unreadable request {path.name}: {e}"})
    return out


def reply_path(request: Path) -> Path:
    return request.with_name("rep-" + request.name.removeprefix("req-"))


def answer(request: Path, reply: dict[str, Any]) -> None:
    _atomic_write(reply_path(request), {**reply, "answered_at": time.time()})
    try:
        os.replace(request, request.with_suffix(".done"))
    except OSError:
        pass


def plan_scale(request: dict[str, Any], live: list[str]) -> tuple[int, list[str]]:
    """(rollouts to add, rollouts to remove) for a request against the live rollouts. Pure.
    `rollouts: N` removes the newest first (the highest-numbered), so the first ones, which
    started with the job, stay."""
    add = int(request.get("add", 0))
    remove = list(request.get("remove", []))
    if request.get("rollouts") is not None:
        target = int(request["rollouts"])
        if target < 1:
            raise ValueError(f"--rollouts {target}: a job needs at least one rollout")
        if target > len(live):
            add += target - len(live)
        else:
            newest = sorted(live, key=_rollout_order, reverse=True)
            remove += newest[:len(live) - target]
    unknown = [r for r in remove if r not in live]
    if unknown:
        raise ValueError(f"--remove {', '.join(unknown)}: no such live rollout (live: {', '.join(sorted(live))})")
    if len(set(remove)) >= len(live) and remove:
        raise ValueError(f"removing {', '.join(remove)} would leave no rollout; the job needs one")
    if add < 0:
        raise ValueError(f"--add {add}: must be positive")
    return add, sorted(set(remove), key=_rollout_order)


def _rollout_order(rid: str) -> tuple[int, int]:
    base, _, incarnation = rid.removeprefix("rollout").partition(".")
    try:
        return int(base), int(incarnation or 0)
    except ValueError:
        return (1 << 30, 0)


# ----------------------------------------------------------------------------- command side


def read_status(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "status.json"
    if not path.exists():
        raise ConfigError(f"'{run_dir}' has no status.json: is it the run directory of a job started "
                          "with the Ray backend (e.g. runs/reverse)? The local backend writes none")
    return json.loads(path.read_text())


def submit(run_dir: Path, request: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """Hand `request` to the running job in `run_dir`; returns its reply."""
    status = read_status(run_dir)
    age = time.time() - status["updated_at"]
    if status.get("finished") or age > STALE_S:
        raise ConfigError(f"no running job in '{run_dir}': its status was last written {age:.0f} s "
                          f"ago{' and it finished' if status.get('finished') else ''}")
    folder = run_dir / "control"
    folder.mkdir(exist_ok=True)
    path = folder / f"req-{time.time():.6f}-{secrets.token_hex(3)}.json"
    _atomic_write(path, {**request, "submitted_at": time.time()})
    reply = reply_path(path)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if reply.exists():
            return json.loads(reply.read_text())
        time.sleep(0.2)
    raise ConfigError(f"the job in '{run_dir}' did not answer within {timeout_s:.0f} s; the request "
                      f"stays in {path} and is applied when the driver reads it")


def render_status(status: dict[str, Any]) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=120, file=io.StringIO())
    age = time.time() - status["updated_at"]
    state = ("finished" if status.get("finished") else
             "running" if age <= STALE_S else "not running (killed, or stopped without a word)")
    console.print(f"job {status.get('job')} ({status.get('mode')}): {state}; status written "
                  f"{age:.1f} s ago; step {status.get('step')}/{status.get('total_steps')}, "
                  f"trainer version {status.get('version')}")
    t = Table(title="rollouts")
    for col in ("rollout", "node", "relay", "version", "in flight", "KV used", "generated tokens"):
        t.add_column(col)
    for r in status.get("rollouts", []):
        t.add_row(r["id"], r.get("node") or "-", r.get("relay") or "-", str(r.get("version")),
                  str(r.get("in_flight")), f"{r.get('kv_util', 0):.0%}", str(r.get("generated_tokens")))
    console.print(t)
    t = Table(title="relay chain, master first")
    for col in ("relay", "address", "newest version"):
        t.add_column(col)
    for r in status.get("relays", []):
        t.add_row(r["id"], r.get("address") or "-", str(r.get("latest")))
    console.print(t)
    pools = status.get("pools", {})
    console.print("pools: " + ", ".join(f"{k} {v}" for k, v in pools.items()))
    if status.get("dead"):
        console.print(f"dead rollouts: {', '.join(status['dead'])}")
    return console.export_text()
