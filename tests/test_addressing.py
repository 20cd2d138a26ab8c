"""Pure parts of multi-node: relay.host resolution, shipping user code, node identity."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from laminar.relay.address import AddressError, resolve_host
from laminar.relay.client import Puller
from laminar.relay.plan import RelayInfo
from laminar.relay.address import node_id
from laminar.plugins import SHIPPED_ENV, shipped_copy
from laminar.runtime.shipping import user_runtime_env

IFACES = {"lo": ["127.0.0.1"], "eth0": ["192.0.2.7"], "ib0": ["10.20.3.4"], "docker0": []}


def test_auto_is_loopback_alone_and_the_node_address_on_a_cluster():
    assert resolve_host("auto", None, IFACES) == ("127.0.0.1", "127.0.0.1")
    assert resolve_host("auto", "192.0.2.7", IFACES) == ("192.0.2.7", "192.0.2.7")


def test_interface_and_cidr_pick_this_nodes_address():
    assert resolve_host("ib0", "192.0.2.7", IFACES) == ("10.20.3.4", "10.20.3.4")
    assert resolve_host("10.20.0.0/16", "192.0.2.7", IFACES) == ("10.20.3.4", "10.20.3.4")


def test_wildcard_binds_everything_but_never_advertises_it():
    assert resolve_host("0.0.0.0", "192.0.2.7", IFACES) == ("0.0.0.0", "192.0.2.7")
    assert resolve_host("0.0.0.0", None, IFACES) == ("0.0.0.0", "127.0.0.1")


@pytest.mark.parametrize("spec, words", [
    ("10.99.0.0/16", ["no address inside 10.99.0.0/16", "eth0 192.0.2.7"]),
    ("docker0", ["interface docker0 has no IPv4"]),
    ("192.0.2.99", ["not an address on node", "CIDR"]),
    ("127.0.0.1", ["loopback", "relay.host=auto"]),
    ("nonsense", ["not an interface", "auto"]),
    ("10.0.0.0/99", ["not a valid CIDR"]),
])
def test_wrong_hosts_are_errors_that_name_key_value_node_and_interfaces(spec, words):
    with pytest.raises(AddressError) as e:
        resolve_host(spec, "192.0.2.7", IFACES, node="node 192.0.2.7")
    assert f"relay.host='{spec}'" in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_puller_refuses_a_relay_of_another_node(tmp_path):
    here = node_id(tmp_path)
    Puller(RelayInfo("r", "127.0.0.1", 1, here, "lam-x"), _relay_cfg(tmp_path)).close()
    with pytest.raises(RuntimeError, match="only its own node's relay"):
        Puller(RelayInfo("r", "10.0.0.9", 1, "other-host/boot/7", "lam-x"), _relay_cfg(tmp_path))


def _relay_cfg(path):
    from laminar.config import RelayConfig

    return RelayConfig(shm_dir=str(path))


def test_node_identity_follows_the_shared_memory_filesystem(tmp_path):
    # /dev/shm and a folder on another filesystem: different tmpfs, different node identity
    assert node_id("/dev/shm") == node_id("/dev/shm")
    assert node_id("/dev/shm").rsplit("/", 1)[0] == node_id(tmp_path).rsplit("/", 1)[0]
    assert node_id("/dev/shm") != node_id(tmp_path)  # same host and boot, another filesystem


def test_user_code_is_staged_and_found_from_the_shipped_copy(tmp_path, monkeypatch):
    user = tmp_path / "job"
    (user / "helpers").mkdir(parents=True)
    (user / "my_reward.py").write_text("from helpers import bonus\ndef score(p, r, a):\n    return bonus()\n")
    (user / "helpers" / "__init__.py").write_text("def bonus():\n    return 0.5\n")
    (user / "words.txt").write_text("alpha\n")
    (user / "big.bin").write_bytes(b"\0" * 10)  # not code, not a data file: stays behind
    (user / "run").mkdir()
    (user / "run" / "metrics.jsonl").write_text("{}\n")  # the job's own run directory: stays
    task = SimpleNamespace(reward=f"{user / 'my_reward.py'}:score", env=None, agent=None)
    staging = tmp_path / "staging"
    staging.mkdir()
    env, notes = user_runtime_env(task, staging, [user / "run"])
    [package] = env["py_modules"]
    shipped = json.loads(env["env_vars"][SHIPPED_ENV])
    assert shipped == {str(user): package.rsplit("/", 1)[1]}
    copied = sorted(p.relative_to(package).as_posix() for p in __import__("pathlib").Path(package).rglob("*")
                    if p.is_file())
    assert copied == ["__init__.py", "helpers/__init__.py", "my_reward.py", "words.txt"]
    assert "task.reward" in notes[0]
    # a node without the driver's folder: import_target loads the shipped copy
    (user / "my_reward.py").rename(tmp_path / "gone.py")
    monkeypatch.setenv(SHIPPED_ENV, env["env_vars"][SHIPPED_ENV])
    monkeypatch.syspath_prepend(str(staging))
    assert shipped_copy(user / "my_reward.py") is not None
    from laminar.plugins import import_target

    fn = import_target(task.reward, "task.reward")
    assert fn("p", "r", "a") == 0.5
    sys.modules.pop("helpers", None)


def test_installed_packages_are_not_shipped(tmp_path):
    task = SimpleNamespace(reward="laminar.tasks.rewards:exact_match_reward", env="json:loads", agent=None)
    assert user_runtime_env(task, tmp_path) == ({}, [])


def test_status_orders_a_chain_and_reports_link_speeds():
    from laminar.devcluster.status import _chain_position, link_speed_gbit, render

    relays = [{"id": "node2", "successor": None, "info": {"host": "10.0.0.3", "port": 3},
               "latest": 4, "versions": [3, 4], "failures": [],
               "arrivals": {"3": {"bytes": 125_000_000, "seconds": 1.0},
                            "4": {"bytes": 125_000_000, "seconds": 2.0}}},
              {"id": "node0", "successor": "node1", "info": {"host": "10.0.0.1", "port": 1},
               "latest": 4, "versions": [4], "failures": []},
              {"id": "node1", "successor": "node2", "info": {"host": "10.0.0.2", "port": 2},
               "latest": 4, "versions": [4], "failures": []},
              {"id": "node9", "error": "TimeoutError: no heartbeat within 10s"}]
    relays.sort(key=lambda r: _chain_position(r, relays))
    assert [r["id"] for r in relays] == ["node0", "node1", "node2", "node9"]
    assert link_speed_gbit(relays[2]) == pytest.approx(1.0)  # median of 0.5 and 1.0: the upper
    assert link_speed_gbit(relays[1]) is None
    text = render({"address": "10.0.0.1:6379", "jobs": {"abc": relays},
                   "nodes": [{"id": "n" * 20, "ip": "10.0.0.1", "alive": True, "cpus": 4.0, "head": True}]})
    assert "node0 (master)" in text and "10.0.0.3:3" in text and "no heartbeat" in text
