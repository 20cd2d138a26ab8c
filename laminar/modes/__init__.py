"""Schedules: one short file per mode over the same components (DESIGN.md §6)."""

from __future__ import annotations

from laminar.config import Config, ConfigError


def run_training(cfg: Config) -> dict[str, float]:
    if cfg.mode == "sync":
        from laminar.modes.sync import run

        return run(cfg)
    raise ConfigError(f"mode='{cfg.mode}' needs the asynchronous runtime, which is not built yet; "
                      "use mode=sync")
