"""Shared fixtures. One local Ray cluster per test session (starting one costs ~4 s)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real embedded Ray cluster, shared by every test that asks for it."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
    yield ray
    ray.shutdown()
