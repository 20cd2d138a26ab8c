"""Which address a relay binds and which it tells the others: pure, given the node's interfaces.

    bind, advertise = resolve_host("10.77.0.0/16", node_ip="10.77.3.2", interfaces=local_interfaces())

`relay.host` may be
- `auto` (default): the node's address on the Ray cluster when the job runs on one (so relays on
  different machines can reach each other), loopback on an embedded single-machine cluster;
- an interface name (`eth1`, `ib0`): that interface's IPv4 address on every node — the usual way
  to put the weights on a dedicated network;
- a CIDR (`10.77.0.0/16`): the node's address inside it;
- an address: bound as is (only right when every relay runs on one machine: on a cluster each
  node has its own address, so use an interface or a CIDR);
- `0.0.0.0` / `::`: listen on every interface, advertise the node's cluster address (never
  0.0.0.0 itself, which no peer can connect to).

Errors are `AddressError`s that name the key, the value, the node and its interfaces.

`node_id(shm_dir)` names the machine whose shared memory a process sees: a relay and a client
with equal ids exchange weights through that directory.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from pathlib import Path

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::")


class AddressError(ValueError):
    pass


def node_id(shm_dir: str | os.PathLike[str] = "/dev/shm") -> str:
    """Identity of this machine's shared memory: relays and clients with equal ids share the shm
    directory (the same host, boot and tmpfs: nodes in their own mount namespaces differ)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        dev = os.stat(shm_dir).st_dev
    except OSError:
        dev = 0
    return f"{socket.gethostname()}/{boot}/{dev}"


def local_interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses, on this machine (this network namespace)."""
    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def _describe(interfaces: Mapping[str, list[str]]) -> str:
    return ", ".join(f"{n} {'/'.join(a) or '(no IPv4)'}" for n, a in sorted(interfaces.items()))


def resolve_host(spec: str, node_ip: str | None, interfaces: Mapping[str, list[str]],
                 node: str = "this node") -> tuple[str, str]:
    """(address to bind, address to advertise) for `relay.host = spec` on a node whose cluster
    address is `node_ip` (None: a single machine) and whose interfaces are `interfaces`."""
    spec = spec.strip()
    where = f"on {node} (its interfaces: {_describe(interfaces)})"
    if spec == "auto":
        ip = node_ip or LOOPBACK
        return ip, ip
    if spec in WILDCARDS:
        ip = node_ip or LOOPBACK
        return spec, ip
    if spec in interfaces:
        ips = interfaces[spec]
        if not ips:
            raise AddressError(f"relay.host='{spec}': interface {spec} has no IPv4 address {where}")
        return ips[0], ips[0]
    if "/" in spec:
        try:
            net = ipaddress.ip_network(spec, strict=False)
        except ValueError:
            raise AddressError(f"relay.host='{spec}' is not a valid CIDR (e.g. 10.0.0.0/16)") from None
        for name in sorted(interfaces):
            for ip in interfaces[name]:
                if ipaddress.ip_address(ip) in net:
                    return ip, ip
        raise AddressError(f"relay.host='{spec}': no address inside {spec} {where}; set relay.host "
                           "to a network every node has an address in, or to an interface name")
    try:
        ipaddress.ip_address(spec)
    except ValueError:
        raise AddressError(f"relay.host='{spec}' is not an interface {where}, a CIDR or an address; "
                           "use auto, an interface name (eth0), a CIDR (10.0.0.0/16) or an "
                           "address") from None
    if spec.startswith("127.") and node_ip and not node_ip.startswith("127."):
        raise AddressError(f"relay.host='{spec}' is loopback, but the job runs on a cluster "
                           f"({node} is {node_ip}): relays on other nodes could not reach it; use "
                           "relay.host=auto, an interface name or a CIDR")
    if not any(spec in ips for ips in interfaces.values()):
        raise AddressError(f"relay.host='{spec}' is not an address {where}: on a cluster every node "
                           "has its own address, so name an interface (relay.host=eth1) or a CIDR "
                           "(relay.host=10.0.0.0/16) instead")
    return spec, spec
