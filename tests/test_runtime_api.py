"""The typed seams of the driver side: both runtimes implement every method of the `Runtime`
Protocol (laminar/runtime/api.py) with its parameters, and every schedule's policy carries
every attribute of the `Policy` Protocol that the runtimes read (no `getattr(..., default)`)."""

from __future__ import annotations

import inspect

import pytest

from laminar.config import load_config
from laminar.modes import MODES, schedule
from laminar.rollout.policy import Policy
from laminar.runtime import Runtime
from laminar.runtime.cluster import ClusterRuntime
from laminar.runtime.local import LocalRuntime


def _protocol_methods(proto: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(proto).items()
            if callable(fn) and (not name.startswith("_") or name in ("__enter__", "__exit__"))}


def _parameters(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults: what a caller relies on (the annotations of a pending call
    differ by design: a Ray ObjectRef or `Done`)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("runtime", [ClusterRuntime, LocalRuntime], ids=lambda c: c.__name__)
def test_both_runtimes_have_every_method_of_the_driver_api_with_its_parameters(runtime):
    methods = _protocol_methods(Runtime)
    assert {"generate", "sync_weights", "train", "wait", "result", "finish", "trainer_rows",
            "request_eval", "process_ids", "scale_up"} <= set(methods)
    for name, sig in methods.items():
        impl = getattr(runtime, name, None)
        assert callable(impl), f"{runtime.__name__} lacks {name}"
        assert _parameters(inspect.signature(impl)) == _parameters(sig), (
            f"{runtime.__name__}.{name}{inspect.signature(impl)} != Runtime.{name}{sig}")
    assert isinstance(runtime.one_process, bool)


def test_the_runtime_protocol_names_every_attribute_the_driver_reads():
    assert {"cfg", "start_version", "started_at", "task", "job", "resumed",
            "one_process"} <= set(Runtime.__annotations__)


@pytest.mark.parametrize("mode", MODES)
def test_every_schedules_policy_carries_every_attribute_the_runtimes_read(mode):
    cfg = load_config(None, [f"mode={mode}"])
    policy = schedule(mode).policy(cfg)
    for name in Policy.__annotations__:
        assert hasattr(policy, name), f"the {mode} policy lacks {name}"
    assert isinstance(policy.mixes_versions, bool) and isinstance(policy.repacks, bool)
    assert isinstance(policy.defers_resumed, bool)
    assert policy.max_outstanding is None or isinstance(policy.max_outstanding, int)
    assert callable(policy.decide)
