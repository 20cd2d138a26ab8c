"""What the driver keeps up to date for operators, in the run directory:

- RUN_DIR/processes.json (which process is which) and RUN_DIR/faults-JOB.json (the manager's
  fault records), rewritten when they change: for an operator's scripts and `laminar bench
  faults`, which kill processes by these ids;
- RUN_DIR/status.json (at most once a second; `laminar status`) and the answers to the
  requests of `laminar scale` (the control channel, control.py).

One process (`cluster.backend: local`) has no processes to name and cannot scale: it writes
none of these files and refuses every scale request.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from laminar.observe import control
from laminar.runtime.api import ONE_PROCESS_SCALE, Runtime
from laminar.types import RolloutSnapshot


class OperatorFiles:
    def __init__(self, rt: Runtime, log_event: Callable[[str, str], None]) -> None:
        self.rt, self.cfg, self.log_event = rt, rt.cfg, log_event
        self.published_key = ""  # what processes.json / faults-JOB.json last said
        self.status_at = -1e9  # when RUN_DIR/status.json was last written

    def publish(self, manager: dict[str, Any], restarts: int) -> None:
        """processes.json and faults-JOB.json, when the rollouts, the chain, the faults or the
        trainer restarts changed."""
        if self.rt.one_process:
            return  # one process: nothing to name
        key = json.dumps([manager["workers"], manager["chain"], manager.get("faults"), restarts])
        if key == self.published_key:
            return
        run_dir = self.cfg.resolved_run_dir
        ids = self.rt.process_ids(manager)
        if ids["trainer"] is None:
            return  # restarting: try again at the next poll
        write_json(run_dir / "processes.json", ids)
        write_json(run_dir / f"faults-{ids['job']}.json", manager.get("faults", []))
        self.published_key = key

    def control(self, manager: dict[str, Any], snaps: dict[str, RolloutSnapshot], step: int | None,
                version: int, finished: bool = False) -> None:
        """status.json (at most once a second; `step`, `version`: the newest trainer row's) and
        the requests of `laminar scale`, each answered after the status it changed."""
        run_dir = self.cfg.resolved_run_dir
        if self.rt.one_process:
            for path, _ in control.pending_requests(run_dir):
                control.answer(path, {"ok": False, "message": ONE_PROCESS_SCALE})
            return
        requests = control.pending_requests(run_dir)
        for path, request in requests:
            reply = self._apply(request, manager)
            manager, snaps = self.rt.manager_stats(), self.rt.snapshots()
            control.write_status(run_dir, self._status(manager, snaps, step, version, finished))  # before the reply
            control.answer(path, reply)
        now = time.monotonic()
        if finished or requests or now - self.status_at >= control.STATUS_EVERY_S:
            self.status_at = now
            control.write_status(run_dir, self._status(manager, snaps, step, version, finished))

    def _apply(self, request: dict[str, Any], manager: Mapping[str, Any]) -> dict[str, Any]:
        live = [w for w in manager["workers"] if w not in manager["dead"]]
        try:
            add, remove = control.plan_scale(request, live)
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

    def _status(self, manager: Mapping[str, Any], snaps: Mapping[str, RolloutSnapshot],
                step: int | None, version: int, finished: bool) -> dict[str, Any]:
        nodes = self.rt.rollout_nodes()
        relays = manager.get("worker_relay", {})
        addresses = manager.get("relay_addresses", {})
        versions = manager.get("relay_versions", {})
        return {
            "job": self.rt.job, "mode": self.cfg.mode, "finished": finished,
            "step": step, "total_steps": self.cfg.trainer.total_steps, "version": version,
            "rollouts": [{"id": w, "node": nodes.get(w), "relay": relays.get(w), "version": s.version,
                          "in_flight": s.num_in_flight, "kv_util": s.kv_utilization,
                          "generated_tokens": s.counters.generated_tokens}
                         for w, s in sorted(snaps.items())],
            "starting": manager.get("spawning", []), "dead": manager.get("dead", []),
            "relays": [{"id": r, "address": addresses.get(r), "latest": versions.get(r)}
                       for r in manager["chain"]],
            "relay_joins": manager.get("relay_joins", []),
            "pools": self.rt.pool_depths(),
        }


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")  # atomic: a reader never sees half a file
    tmp.write_text(json.dumps(value, default=str))
    os.replace(tmp, path)
