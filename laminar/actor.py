"""What the actor shells (laminar/*/actor.py) share: where an actor runs, why its start failed,
and the starting model on its node.

- `alive_nodes()`: Ray node id -> address, of the cluster's live nodes; `pin(node)`: the Ray
  options that keep an actor on one node.
- `start_failure(e)`: (class name, message) of what made an actor's constructor fail, out of
  Ray's wrapping.
- `ShippedDir` / `fingerprint` / `pack` / `materialize`: the starting model directory (a local
  Hugging Face directory, or the SFT warm start) goes through Ray's object store once (the
  runtime packs it); a rollout or trainer on a node without that directory unpacks it into a
  node-local cache keyed by the directory's fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def alive_nodes() -> dict[str, str]:
    """Ray node id -> address, of the cluster's live nodes."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def pin(node: str | None) -> dict[str, Any]:
    """Ray options that keep an actor on `node` (None: anywhere, one machine)."""
    if node is None:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def start_failure(e: BaseException) -> tuple[str, str]:
    """(exception class name, its message) of what made an actor's constructor fail, out of
    Ray's wrapping (ActorDiedError / RayTaskError text around the original exception)."""
    head = re.compile(r"^\s*(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): ?(.*)$")
    text = str(getattr(e, "cause", None) or e)
    kind, message = type(e).__name__, next(
        (ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), repr(e))
    for line in reversed(text.splitlines()):
        if head.match(line):
            kind, message = head.match(line).groups()
            while (m := head.match(message)) and kind in ("ActorDiedError", "RayActorError", "RayTaskError"):
                kind, message = m.groups()  # unwrap Ray's own layers
            break
    return kind, f"{kind}: {message.strip()}"


@dataclass(frozen=True)
class ShippedDir:
    """A directory in Ray's object store: `files` is an ObjectRef of {relative path: bytes}."""

    source: str  # the driver's path
    fingerprint: str
    files: Any


def fingerprint(directory: Path) -> str:
    h = hashlib.sha1()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(directory)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def pack(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def materialize(model: "str | ShippedDir") -> str:
    """A path to the model directory on this node: the driver's path where it exists with the
    same content, else an unpacked copy in a node-local cache (once per fingerprint)."""
    if isinstance(model, str):
        return model
    src = Path(model.source)
    if src.is_dir() and fingerprint(src) == model.fingerprint:
        return str(src)
    cache = Path(tempfile.gettempdir()) / "laminar-models" / model.fingerprint
    if (cache / ".complete").exists():
        return str(cache)
    files = ray.get(model.files)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.part")
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    (tmp / ".complete").touch()
    try:
        tmp.rename(cache)
    except OSError:  # another rollout on this node unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(cache)
