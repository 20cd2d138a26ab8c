"""Does Ray start here? A local cluster started and stopped once, for `laminar doctor --ray`."""

from __future__ import annotations

import contextlib
import sys
import time

import ray

from laminar.runtime import ray_env_defaults


def local_cluster() -> tuple[float, dict[str, float]]:
    """(seconds to start and stop a one-CPU local cluster, its resources); Ray's own exception
    when it cannot start."""
    ray_env_defaults()  # the environment laminar's own jobs start Ray with
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # keep the caller's stdout pure (--json)
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        res = ray.cluster_resources()
        ray.shutdown()
    return time.perf_counter() - t0, res
