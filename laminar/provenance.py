"""Where a result came from: commit, date, versions, machine, command and config.

Every benchmark JSON carries `provenance()` under the key `provenance`, so a figure quoted in
`docs/` can be traced to the code and the machine that produced it (DESIGN.md §7).

Versions are read with `importlib.metadata`, never by importing the package: asking for
torch's version must not cost torch's import time.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REQUIRED = ("torch", "transformers", "ray", "numpy")
OPTIONAL = ("trl", "datasets", "accelerate")

_CHECKOUT = Path(__file__).resolve().parents[1]


def provenance(config: dict | None = None, command: str | None = None) -> dict[str, Any]:
    """The record to store beside a result; `command` defaults to this process's command line."""
    commit, dirty = git_commit(_CHECKOUT)
    return {
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "machine": platform.platform(),
        "command": command if command is not None else command_line(sys.argv),
        "config": config,
    }


def git_commit(root: Path) -> tuple[str | None, bool | None]:
    """(HEAD, whether tracked files differ from it), or (None, None) outside a git checkout."""
    if not (root / ".git").exists():
        return None, None
    try:
        head = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):  # no git binary, or not a repository
        return None, None
    return head.strip(), bool(status.strip())


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True, timeout=10).stdout


def versions() -> dict[str, str | None]:
    """python and the libraries a result depends on; None for an optional one not installed."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in REQUIRED + OPTIONAL:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line(argv: list[str]) -> str:
    """argv as a reader would retype it: `laminar bench engine --out F`, `python -m laminar.x`."""
    if not argv:
        return ""
    head = Path(argv[0])
    if head.name == "laminar":
        prog = "laminar"
    elif head.suffix == ".py" and _CHECKOUT in head.resolve().parents:
        module = head.resolve().relative_to(_CHECKOUT).with_suffix("")
        parts = module.parts[:-1] if module.name == "__main__" else module.parts
        prog = "python -m " + ".".join(parts)
    else:
        prog = head.name
    return " ".join([prog, *argv[1:]])


def write_result(out: str | None, result: dict[str, Any]) -> None:
    """Write a benchmark's result JSON to `out` (folders made as needed), if one is given."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
