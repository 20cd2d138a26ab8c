"""What every section of the config tree shares: the `Section` base (unknown keys refused),
the mode and device vocabularies, and the two errors the CLI prints without a traceback."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict

Mode = Literal["laminar", "sync", "one_step", "stream", "partial"]
MODES: tuple[str, ...] = get_args(Mode)  # the one list of schedules (laminar/modes/<mode>.py)
GLOBAL_BATCH_MODES = ("sync", "one_step", "stream")  # the ones whose waits come one at a time
PRESET_POSITIONS = 1024  # max_position_embeddings of a model.preset model (models/builder.py)
Device = Literal["auto", "cpu", "cuda"]  # laminar/devices.py resolves it in each process
DEVICES: tuple[str, ...] = get_args(Device)


def device_setting(value: Any, key: str) -> Any:
    """`trainer.device` / `rollout.device`: case and spaces forgiven; `gpu` and `cuda:N` named."""
    if not isinstance(value, str):
        return value
    v = value.strip().lower()
    if v == "gpu":
        raise ValueError(f"{value!r} is not a {key} setting: say cuda (a CUDA GPU), cpu or auto")
    if v.startswith("cuda:"):
        raise ValueError(f"{value!r}: a process uses the GPU it is given (Ray's GPU "
                         "resources or CUDA_VISIBLE_DEVICES), so the setting is cuda, not cuda:N")
    return v


class ConfigError(ValueError):
    """A user mistake in a config file or override; the CLI prints it without a traceback."""


class RunStopped(RuntimeError):
    """A run stopped for a reason its user can act on (e.g. training diverged); the CLI prints
    the message in one line, no traceback. The message says what was saved and how to go on."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
