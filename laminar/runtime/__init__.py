"""Where the components run, behind one driver API: a Ray cluster or one process.

    with open_runtime(cfg, model_dir, start_version, policy) as rt:
        rt.wait(rt.generate(B), "generation")           # what laminar/modes/<mode>.py calls

- `cluster.py` (`cluster.backend: ray`): every component a Ray actor, on an embedded local
  cluster or the one `cluster.address` names; `relays.py` starts and heartbeats the relays.
- `local.py` (`cluster.backend: local`): the same loop, trainer and pools in one process, no
  Ray, for debugging a task or a reward.

The driver API, the same for both:
    generate(num_groups) -> pending      deal one global batch out to the rollouts
    sync_weights(version)                every rollout gets to `version` (its policy says how)
    train(method) -> pending             a trainer call: train_once | train_streaming |
                                         train_next | run
    wait(pending, what) -> value         wait at most cluster.wait_timeout_s, naming what
    ready(pending, timeout_s) -> bool    done yet?
    result(pending) -> value             raises TrainerRestarted if the trainer died meanwhile
    request_eval(job) -> rollout id      a held-out evaluation (laminar/rollout/evals.py), by
                                         the next rollout in turn
    take_records(close) -> {rollout: {"evals", "spans", "env_latency_s", "turns"}}   since the last call
    idle(seconds)                        let the rollouts run (local: steps them)
    trainer_rows(since), snapshots(), manager_stats(), finish()
    start_version, cfg, started_at      (the unix time the rollouts were started: rows count from it)
"""

from __future__ import annotations

import os
from typing import Any

from laminar.config import Config
from laminar.rollout.policy import Policy


# What the Ray processes this one starts inherit, unless the user set it. Ray runs every worker
# at nice 15 by default: on a machine shared with any process at normal priority, the whole job
# (the trainer too) then gets about a 28th of that process's CPU share, while the driver, which
# only follows, keeps full priority. laminar's workers run at the driver's priority; rollouts
# still yield to the trainer by rollout.cpu_nice.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def ray_env_defaults() -> None:
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


class TrainerRestarted(RuntimeError):
    """The trainer died during a call; it restarts from its newest checkpoint, so the driver
    makes the call again."""


def open_runtime(cfg: Config, model_dir: str, start_version: int, policy: Policy) -> Any:
    """A runtime for `cfg.cluster.backend`, to be used as a context manager."""
    if cfg.cluster.backend == "local":
        from laminar.runtime.local import LocalRuntime

        return LocalRuntime(cfg, model_dir, start_version, policy)
    from laminar.runtime.cluster import ClusterRuntime

    return ClusterRuntime(cfg, model_dir, start_version, policy)
