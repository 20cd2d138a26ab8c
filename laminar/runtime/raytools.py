"""Low-level Ray helpers of a job: joining or starting a cluster, actor options, waiting on
many calls at once. Nothing here knows which component an actor is.

- `init_ray(cfg, secret)`: join `cluster.address` (checked first: an address where nothing
  answers is a ConfigError within seconds) or start an embedded local cluster with the
  dashboard off; every process of the job gets the job secret as `$relay.secret_env`.
- `ray_resources`: a `cluster.*_resources` mapping as Ray's actor options.
- `wait_all`: every answer, or a TimeoutError naming the calls that gave none;
  `answers`: the answers that came in time, from actors still alive.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from laminar.config import Config, ConfigError
from laminar.devices import leave_trainer_cores
from laminar.runtime import ray_env_defaults
from laminar.runtime.shipping import user_runtime_env

LIGHT = {"num_cpus": 0}
THREADED = {"num_cpus": 0, "max_concurrency": 8}


def ray_resources(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options reserving `resources` (a `cluster.*_resources` mapping such as
    {GPU: 0.5, accel: 1}): Ray takes CPUs and GPUs as `num_cpus` / `num_gpus`, and refuses them
    inside `resources`; every other name is a custom resource."""
    opts: dict[str, Any] = {}
    if "CPU" in resources:
        opts["num_cpus"] = float(resources["CPU"])
    if "GPU" in resources:
        opts["num_gpus"] = float(resources["GPU"])
    custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        opts["resources"] = custom
    return opts


def check_address(address: str) -> None:
    """`cluster.address` is host:port or ray://host[:port] and something answers there; else a
    ConfigError (ray.init would retry it for minutes)."""
    client = address.startswith("ray://")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep:  # no port: Ray Client's default, or a GCS address without one
        host, port = address.removeprefix("ray://"), "10001" if client else ""
    if not host or not port.isdigit():
        raise ConfigError(f"cluster.address='{address}' is not host:port or "
                          "ray://host[:port] (e.g. 10.0.0.5:6379, ray://head:10001, auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10.0).close()
    except OSError as e:
        raise ConfigError(
            f"cluster.address='{address}': nothing answers at {host}:{port} ({e}). Start "
            "the cluster there (`ray start --head` on that machine), fix the address, or "
            "unset cluster.address to run on an embedded local cluster") from None


def init_ray(cfg: Config, secret: bytes) -> str | None:
    """Join `cluster.address` or start an embedded cluster (Ray must not be initialised yet).
    On a cluster, the user's code is staged for shipping (shipping.py); returns that staging
    folder (None: nothing staged), for the caller to remove at the end. Every process of the
    job gets the job secret as $relay.secret_env (the rollouts' OpenAI endpoint takes it as its
    key; relays and the trainer get it as an argument)."""
    ray_env_defaults()
    address = cfg.cluster.address
    if address and address not in ("auto", "local"):
        check_address(address)
    staging = None
    if address:
        staging = tempfile.mkdtemp(prefix="laminar-ship-")
        runtime_env, notes = user_runtime_env(cfg.task, Path(staging), [Path(cfg.resolved_run_dir)])
        for note in notes:
            print(f"shipping {note}", flush=True)
    else:
        runtime_env = {}
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), cfg.relay.secret_env: secret.decode()}
    try:
        if address:
            ray.init(address=address, include_dashboard=False, runtime_env=runtime_env,
                     log_to_driver=True, configure_logging=False)
        else:
            leave_trainer_cores(cfg)  # cluster.cpu_affinity=split: Ray starts off the trainer's cores
            ray.init(num_cpus=cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                     runtime_env=runtime_env, log_to_driver=True, configure_logging=False)
    except BaseException:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def wait_all(refs: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """ray.get every ref; on timeout, fail naming the components that did not answer."""
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    stuck = [n for n, ref in refs.items() if ref not in ready]
    if stuck:
        raise TimeoutError(f"no answer within {timeout_s:.0f}s (cluster.wait_timeout_s) from: "
                           f"{', '.join(stuck)}")
    return {n: ray.get(ref) for n, ref in refs.items()}


def answers(refs: dict[str, Any], timeout_s: float = 10) -> dict[str, Any]:
    """The answers that came within `timeout_s`, from actors still alive."""
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out = {}
    for w, ref in refs.items():
        if ref in ready:
            try:
                out[w] = ray.get(ref)
            except ray.exceptions.RayActorError:
                pass
    return out
