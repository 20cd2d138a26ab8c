"""User code that a config names, loaded: `package.module:name` or `my_file.py:name`.

    fn = import_target("my_reward.py:score", "task.reward")     # -> the object, or ConfigError

- `import_target`: a dotted module is imported; a `.py` file is imported as a module of its own
  (once per process, its folder on sys.path for its own imports). Errors name the config key.
- `shipped_copy`: on a cluster node where the driver's file does not exist, the copy that the
  runtime shipped (laminar/runtime/shipping.py) into a package `laminar_user_<hash>`;
  `SHIPPED_ENV` (an environment variable of every worker) maps the driver's folder to it.

Rewards (tasks/rewards.py), environments (envs/base.py) and agents (envs/openai_agent.py) are
loaded through here.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from laminar.config import ConfigError

SHIPPED_ENV = "LAMINAR_SHIPPED"


def import_target(path: str, key: str, kind: str = "function") -> Any:
    """`package.module:name` or `my_file.py:name` (a file path, absolute or relative to the
    current folder; configs make theirs absolute) -> the object; a ConfigError naming `key`."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}='{path}' is not of the form package.module:{kind} or "
                          f"my_file.py:{kind}")
    if module_name.endswith(".py"):
        module = _module_from_file(path, module_name, key)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"{key}='{path}': cannot import module '{module_name}' ({e}); "
                              "is it installed or on PYTHONPATH? (a file beside your config: "
                              f"{key}: my_file.py:{kind})") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{key}='{path}': module '{module_name}' has no {kind} '{attr}'")
    return getattr(module, attr)


def _module_from_file(path: str, file: str, key: str) -> Any:
    """Import `file` (a .py path) as a module of its own, once per process."""
    where = Path(file).resolve()
    if not where.is_file():
        copy = shipped_copy(where)  # on a cluster node: the shipped copy
        if copy is None:
            raise ConfigError(f"{key}='{path}': no file {where}; give a path relative to the "
                              "config file (or absolute)")
        where = copy
    name = f"laminar_user_{where.stem}_{abs(hash(str(where))) % 10**8}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(where.parent))  # its own imports of files beside it
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{key}='{path}': importing {where} failed: "
                          f"{type(e).__name__}: {e}") from None
    sys.modules[name] = module
    return module


def shipped_copy(file: Path) -> Path | None:
    """Where the copy of the driver's `file` is on this node (None: not shipped here)."""
    shipped = json.loads(os.environ.get(SHIPPED_ENV) or "{}")
    package = shipped.get(str(file.parent))
    if package is None:
        return None
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    copy = Path(list(spec.submodule_search_locations)[0]) / file.name
    return copy if copy.is_file() else None
