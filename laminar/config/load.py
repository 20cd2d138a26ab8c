"""Loading: YAML (or the defaults) plus dotted command-line overrides, validated into a
`Config`; every user mistake becomes one `ConfigError` whose message names the key, the value
and what is allowed (a close match for a typo, the replacement of a retired key).

    cfg = load_config("examples/reverse.yaml", ["trainer.lr=1e-4", "rollout.num_workers=4"])
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from laminar.config.base import ConfigError
from laminar.config.schema import Config

# Keys that existed once: loading a config that still sets one says what replaced it.
RETIRED = {
    "trainer.stream_minibatches": "it was removed: laminar and partial always train each "
    "mini-batch as soon as its groups are complete (stream does too); delete the key",
    "trainer.max_staleness": "it was removed: staleness is bounded by pacing instead of by "
    "discarding samples (which biases training toward short responses); use "
    "rollout.max_outstanding_batches (how many global batches generation may run ahead of the "
    "trainer, AReaL's eta + 1) and, in laminar mode, rollout.version_lag",
    "trainer.behaviour_weight_cap": "it moved with decoupled PPO into the off-policy "
    "corrections: write trainer.correction=decoupled trainer.correction.cap=VALUE",
    "relay.rate_limit_mbps": "it was removed: slow links are emulated by the relay benchmark "
    "only (laminar/bench/links.py); delete the key",
}

# Keys that moved: old key -> (new key, why). The value carries over unchanged; a user's config
# that sets the old key is refused with both keys and the value, a run's own saved config.yaml
# (`laminar resume` of a run started by an older laminar) is moved over silently.
RENAMED: dict[str, tuple[str, str]] = {
    "trainer.resume": ("trainer.from_checkpoint", "a checkpoint a new run starts from; the "
                       "top-level `resume` continues a killed job in its own run_dir"),
    "rollout.env_latency": ("bench.env_latency", "emulated tool latency is a benchmark knob, "
                            "kept in the `bench:` section"),
}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                saved_run: bool = False) -> Config:
    """Read YAML (or start from defaults when `path` is None), apply `key.sub=value` overrides,
    validate. Raises ConfigError with a readable message on any user mistake. `saved_run`: the
    file is a run's own config.yaml (written by laminar, perhaps an older one): its renamed keys
    are moved to their new place instead of refused."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass a YAML file such as "
                              "examples/reverse.yaml")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys, "
                              f"not a {type(loaded).__name__}")
        data = loaded or {}
        if saved_run:
            move_renamed(data)
        _anchor_files(data, path.parent)  # file paths in the YAML: relative to the YAML
    for item in overrides:
        apply_override(data, item)
    _anchor_files(data, Path.cwd())  # those given on the command line: relative to here
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source=str(path) if path else "defaults")) from None


TARGET_KEYS = ("reward", "env", "agent")  # task keys naming code: `package.module:name` or `file.py:name`


def _anchor_files(data: dict[str, Any], base: Path) -> None:
    """`task.reward: my_reward.py:score`, `task.env: my_envs.py:Calc`, `task.agent:
    my_agent.py:run` and `task.dataset.path` name files; make a relative one absolute against
    `base` (the config file's folder), so `laminar train my_job.yaml` runs from any folder and
    the run's saved config.yaml (which `laminar resume` reads) still finds it. A dataset path
    found only under the current folder is taken from there; one found nowhere is left as it
    is, for the dataset loader's error to name."""
    task = data.get("task")
    for key in TARGET_KEYS:
        value = task.get(key) if isinstance(task, dict) else None
        if isinstance(value, str):
            module, sep, attr = value.rpartition(":")
            if sep and module.endswith(".py") and not Path(module).is_absolute():
                task[key] = f"{(base / module).resolve()}:{attr}"
    dataset = task.get("dataset") if isinstance(task, dict) else None
    path = dataset.get("path") if isinstance(dataset, dict) else None
    if isinstance(path, str) and path and not Path(path).is_absolute():
        # task.dataset.path: beside the config like the code files; a file that is not there
        # but is under the folder laminar runs in is taken from there (how it was read before)
        for folder in (base, Path.cwd()):
            if (folder / path).exists():
                dataset["path"] = str((folder / path).resolve())
                break


def move_renamed(data: dict[str, Any]) -> None:
    """Move every RENAMED key found in `data` to its new place (one already set there wins),
    and an older run's decoupled PPO (`trainer.old_logprobs=decoupled`, its cap in
    `trainer.behaviour_weight_cap`) to `trainer.correction`."""
    trainer = _section(data, ["trainer"])
    if trainer is not None and "behaviour_weight_cap" in trainer:
        cap = trainer.pop("behaviour_weight_cap")
        if trainer.get("old_logprobs") == "decoupled":
            del trainer["old_logprobs"]
            trainer["correction"] = {"kind": "decoupled", "cap": cap}
    for old, (new, _) in RENAMED.items():
        *parents, leaf = old.split(".")
        node = _section(data, parents)
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        *parents, leaf = new.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node.setdefault(leaf, value)


def _section(data: dict[str, Any], parts: list[str]) -> dict[str, Any] | None:
    node: Any = data
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' is not of the form key.subkey=value "
                          "(for example trainer.lr=1e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if isinstance(child, str) and part == "correction":  # trainer.correction=NAME
            raise ConfigError(f"override '{item}': {part} was given by name ({child!r}); to set "
                              f"its parameters too, name the kind as a key: "
                              f"trainer.correction.kind={child} {item}")
        if not isinstance(child, dict):
            raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden" and loc in RETIRED:
            lines.append(f"  - '{loc}' = {e.get('input')!r}: {RETIRED[loc]}")
        elif kind == "extra_forbidden" and loc in RENAMED:
            new, why = RENAMED[loc]
            value = e.get("input")
            lines.append(f"  - '{loc}' = {value!r}: the key is now {new} ({why}); write "
                         f"{new}={_as_override(value)}")
        elif kind == "extra_forbidden":
            lines.append(f"  - unknown key '{loc}'. {_allowed_keys_hint(e['loc'])}")
        elif kind == "missing":
            lines.append(f"  - missing key '{loc}': it is required here")
        elif kind == "value_error":
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  - {msg}" if not loc else f"  - '{loc}': {msg}")
        else:
            lines.append(f"  - '{loc}' = {e.get('input')!r}: {e['msg']}")
    return "\n".join(lines)


def _as_override(value: Any) -> str:
    """A value as it would be written after `key=` on the command line."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("\n...")


def _allowed_keys_hint(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = _section_type(field.annotation) if field else None
        if sub is None:
            return ""
        model = sub
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"Did you mean '{close[0]}'? " if close else ""
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    return f"{hint}Allowed keys in {where}: {', '.join(allowed)}"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):  # Optional[Section]
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
