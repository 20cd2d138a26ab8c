"""User code and the starting model, to every node of a cluster.

On one machine every actor sees the driver's files. On a cluster a node has the installed
packages (laminar, its dependencies: an image or an environment set up alike on every node) but
not the driver's folders, so the runtime ships what the config names:

- **files** named as `task.reward: my_reward.py:fn` / `task.env: my_envs.py:Env` (and any other
  `*.py:name` target of the task): the folder holding each is copied into a package
  `laminar_user_<hash>` (its `.py` files and data files of at most 1 MiB: json, yaml, txt,
  csv...; not hidden folders, caches or the job's run directory) and handed to Ray as `runtime_env.py_modules`; `LAMINAR_SHIPPED` (an environment
  variable of every worker) maps the driver's folder to that package, and
  `laminar.plugins.import_target` loads the file from the package's copy on a node where
  the driver's path does not exist.
- **dotted targets** (`my_pkg.rewards:fn`) whose top-level package lives outside
  site-packages (a folder on the driver's PYTHONPATH) go as `py_modules` under their own name;
  installed packages are expected on every node.
- **the starting model directory** (a local Hugging Face directory, or the SFT warm start)
  goes through Ray's object store once; a rollout on a node without that directory unpacks it
  into a node-local cache keyed by the directory's fingerprint (`materialize`, in
  laminar/actor.py, where the actor shells can reach it).

A target that still cannot be imported on a node fails that rollout's start with the config key,
the node's address and the import error (the runtime reports it; see cluster.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sysconfig
from pathlib import Path
from typing import Any

from laminar.config import TARGET_KEYS
from laminar.plugins import SHIPPED_ENV

MAX_FILE = 1 << 20  # data files larger than this stay behind (say so in the log)
MAX_TOTAL = 64 << 20


def targets(task: Any, files: bool) -> list[tuple[str, str]]:
    """(config key, target) of the task's `file.py:name` targets (`files`) or its dotted
    `package.module:name` ones."""
    out = []
    for key in TARGET_KEYS:
        value = getattr(task, key, None)
        if isinstance(value, str) and ":" in value:
            if value.rpartition(":")[0].endswith(".py") == files:
                out.append((f"task.{key}", value))
    return out


def _package_name(folder: Path) -> str:
    return "laminar_user_" + hashlib.sha1(str(folder).encode()).hexdigest()[:10]


DATA = {".json", ".jsonl", ".yaml", ".yml", ".txt", ".csv", ".tsv", ".toml"}


def _stage(folder: Path, into: Path, exclude: list[Path]) -> tuple[Path, list[str]]:
    """Copy `folder`'s code (.py) and small data files into `into/<package>`; returns it and
    what was left behind for size. Hidden folders, caches and `exclude` (the job's run
    directory, when it lies inside) stay behind."""
    dest = into / _package_name(folder)
    skipped, total = [], 0
    for src in sorted(folder.rglob("*")):
        rel = src.relative_to(folder)
        if (any(p.startswith(".") or p == "__pycache__" for p in rel.parts) or not src.is_file()
                or src.suffix not in DATA | {".py"} or any(src.is_relative_to(x) for x in exclude)):
            continue
        size = src.stat().st_size
        if (src.suffix != ".py" and size > MAX_FILE) or total + size > MAX_TOTAL:
            skipped.append(str(rel))
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
        total += size
    (dest / "__init__.py").touch()
    return dest, skipped


def _outside_site_packages(origin: str) -> bool:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    return not any(origin.startswith(r) for r in roots) and "site-packages" not in origin


def user_runtime_env(task: Any, staging: Path, exclude: list[Path] | None = None
                     ) -> tuple[dict[str, Any], list[str]]:
    """Ray `runtime_env` that ships the task's user code, and notes of what was shipped."""
    modules: list[str] = []
    shipped: dict[str, str] = {}
    notes = []
    for key, target in targets(task, files=True):
        folder = Path(target.rpartition(":")[0]).resolve().parent
        if str(folder) in shipped:
            continue
        dest, skipped = _stage(folder, staging, [p.resolve() for p in exclude or []])
        modules.append(str(dest))
        shipped[str(folder)] = dest.name
        notes.append(f"{key}: {folder} -> every node as {dest.name}"
                     + (f" (left behind, too large: {', '.join(skipped[:5])}"
                        f"{'...' if len(skipped) > 5 else ''})" if skipped else ""))
    for key, target in targets(task, files=False):
        top = target.rpartition(":")[0].split(".")[0]
        if top == "laminar":
            continue
        spec = importlib.util.find_spec(top)
        origin = (spec.submodule_search_locations or [spec.origin])[0] if spec else None
        if origin and _outside_site_packages(str(origin)) and str(origin) not in modules:
            modules.append(str(origin))
            notes.append(f"{key}: package {top} ({origin}) -> every node")
    if not modules:
        return {}, notes
    return {"py_modules": modules, "env_vars": {SHIPPED_ENV: json.dumps(shipped)}}, notes
