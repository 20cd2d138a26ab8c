"""Where the components run, behind one driver API: a Ray cluster or one process.

    with open_runtime(cfg, model_dir, start_version, policy) as rt:
        rt.wait(rt.generate(B), "generation")           # what laminar/modes/<mode>.py calls

- `api.py`: the driver API, the `Runtime` Protocol both runtimes implement, and
  `TrainerRestarted`.
- `cluster.py` (`cluster.backend: ray`): `ClusterRuntime`, every component a Ray actor, on an
  embedded local cluster or the one `cluster.address` names. Beside it: `assembly.py` (which
  actors the job starts, with what, where), `raytools.py` (low-level Ray: init, actor options,
  waits), `placement.py` (pure: which relay each rollout pulls from), `shipping.py` (user code
  to every node), `probe.py` (`laminar doctor --ray`). The relay group's Ray edge is
  laminar/relay/actor.py; what every actor shell shares (node pinning, start failures, the
  starting model on every node) is laminar/actor.py.
- `local.py` (`cluster.backend: local`): `LocalRuntime`, the same loop, trainer and pools in one
  process, no Ray, for debugging a task or a reward.

The dev cluster (a real multi-node Ray cluster on one machine) is laminar/devcluster/.
"""

from __future__ import annotations

import os

from laminar.config import Config
from laminar.rollout.policy import Policy
from laminar.runtime.api import Runtime, TrainerRestarted

__all__ = ["RAY_ENV", "Runtime", "TrainerRestarted", "open_runtime", "ray_env_defaults"]


# What the Ray processes this one starts inherit, unless the user set it. Ray runs every worker
# at nice 15 by default: on a machine shared with any process at normal priority, the whole job
# (the trainer too) then gets about a 28th of that process's CPU share, while the driver, which
# only follows, keeps full priority. laminar's workers run at the driver's priority; rollouts
# still yield to the trainer by rollout.cpu_sched and rollout.cpu_nice.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def ray_env_defaults() -> None:
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)


def open_runtime(cfg: Config, model_dir: str, start_version: int, policy: Policy) -> Runtime:
    """A runtime for `cfg.cluster.backend`, to be used as a context manager."""
    if cfg.cluster.backend == "local":
        from laminar.runtime.local import LocalRuntime  # torch and the models: only when chosen

        return LocalRuntime(cfg, model_dir, start_version, policy)
    from laminar.runtime.cluster import ClusterRuntime  # ray, and it imports this package

    return ClusterRuntime(cfg, model_dir, start_version, policy)
