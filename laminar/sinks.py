"""Where metrics rows go besides RUN_DIR/metrics.jsonl: TensorBoard (on by default), Weights &
Biases and MLflow (off unless `metrics.wandb` / `metrics.mlflow`).

    sinks = open_sinks(cfg.metrics, run_dir, cfg.name, cfg.model_dump())
    logger = MetricsLogger(run_dir, total_steps, sinks=sinks)   # every row goes to each sink

Every sink maps a row the same way (`scalars`, `distributions`):

- step rows: `train/<key>` for every number (bools as 0/1; `step` and `time` are the axes, not
  values), a dict of numbers (kv_util_by_rollout, ...) as `train/<key>/<sub>`; global step =
  row["step"]. staleness_hist and env_latency_s are distributions: a histogram where the
  backend has one (TensorBoard, W&B), bucket scalars / quantiles where it does not (MLflow).
- eval rows: `heldout/<key>` for every number, at global step row["step"] (the trainer steps
  done when the evaluation was asked, so it lines up with the training curve).
- event rows: text (`events`), at the newest step seen.
- span rows: skipped. There are several per rollout per second and a scalar plot of them
  would be meaningless; the timeline is read from metrics.jsonl instead.

The W&B and MLflow packages are imported only when enabled; missing ones are a ConfigError
naming the key, so `pip install laminar` does not pull either.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from laminar.config import ConfigError, MetricsConfig

AXES = ("kind", "time", "step")  # row keys that place a value rather than being one
DISTRIBUTIONS = ("staleness_hist", "env_latency_s", "turns")  # step-row keys logged as distributions
PREFIX = {"step": "train", "eval": "heldout"}  # row kind -> tag prefix (the others: no scalars)


def _number(value: Any) -> float | None:
    """A loggable number (bools as 0/1), or None for anything else (None, strings, lists)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """tag -> value of one step or eval row (empty for event and span rows)."""
    prefix = PREFIX.get(row.get("kind", "step"))
    if prefix is None:
        return {}
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in AXES or key in DISTRIBUTIONS:
            continue
        if isinstance(value, dict):
            for sub, inner in value.items():
                number = _number(inner)
                if number is not None:
                    out[f"{prefix}/{key}/{sub}"] = number
            continue
        number = _number(value)
        if number is not None:
            out[f"{prefix}/{key}"] = number
    return out


def staleness_values(hist: dict[str, int]) -> np.ndarray:
    """{"0": 120, "1": 8} -> the 128 staleness values themselves (what a histogram takes)."""
    return np.repeat(np.array([int(k) for k in hist], dtype=float),
                     np.array([int(n) for n in hist.values()], dtype=int))


def distributions(row: dict[str, Any]) -> dict[str, np.ndarray]:
    """tag -> sample values of a step row's distributions (empty ones left out)."""
    if row.get("kind", "step") != "step":
        return {}
    out: dict[str, np.ndarray] = {}
    hist = row.get("staleness_hist")
    if hist and sum(hist.values()):
        out["train/staleness_hist"] = staleness_values(hist)
    for key in ("env_latency_s", "turns"):
        if row.get(key):
            out[f"train/{key}"] = np.asarray(row[key], dtype=float)
    return out


def event_text(row: dict[str, Any]) -> str:
    return f"{row.get('what', '?')}: {row.get('detail', '')}"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"trainer": {"lr": 1e-4}} -> {"trainer.lr": 1e-4} (MLflow params are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value
    return out


def _import(module: str, key: str) -> Any:
    """Import an optional backend, or say which switch asked for it and how to get it."""
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"{key}=true but the `{module}` package is not installed; "
                          f"`pip install {module}`, or set {key}=false") from None


class TensorBoardSink:
    """Event files under RUN_DIR/tensorboard, written by torch's SummaryWriter (it needs only
    the `tensorboard` package, not TensorFlow, and no server): `tensorboard --logdir
    RUN_DIR/tensorboard` reads them, also while the run goes on (flushed every few seconds)."""

    def __init__(self, log_dir: Path, config: dict[str, Any], start_time: float | None = None,
                 flush_secs: int = 5) -> None:
        # lazily: torch is already loaded in a run, not necessarily where this module is imported
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=flush_secs)
        self.t0 = time.time() if start_time is None else start_time  # row["time"] is relative
        self.last_step = 0
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()),
                             global_step=0, walltime=self.t0)

    def write(self, row: dict[str, Any]) -> None:
        kind = row.get("kind", "step")
        if kind == "span":
            return
        walltime = self.t0 + float(row.get("time", time.time() - self.t0))
        step = int(row.get("step", self.last_step))
        if kind == "step":
            self.last_step = max(self.last_step, step)
        if kind == "event":
            self.writer.add_text("events", event_text(row), global_step=self.last_step,
                                 walltime=walltime)
            return
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        for tag, values in distributions(row).items():
            bins: Any = "auto"
            if tag == "train/staleness_hist":  # one bucket per staleness value
                bins = np.arange(-0.5, values.max() + 1.5)
            self.writer.add_histogram(tag, values, global_step=step, bins=bins, walltime=walltime)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run named after the laminar run. Steps and held-out rows have their own x axes
    (`train/step`, `heldout/step`: define_metric), because an evaluation finishes after later
    training steps and W&B's own step may only grow. Events go to an `events` table at close."""

    def __init__(self, project: str, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        self.wandb = _import("wandb", "metrics.wandb")
        self.run = self.wandb.init(project=project, name=run_name, dir=str(run_dir), config=config)
        for prefix in PREFIX.values():
            self.run.define_metric(f"{prefix}/step")
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
        self.events: list[list[Any]] = []

    def write(self, row: dict[str, Any]) -> None:
        kind = row.get("kind", "step")
        if kind == "event":
            self.events.append([row.get("time"), row.get("what"), row.get("detail")])
            return
        if kind not in PREFIX:
            return
        data: dict[str, Any] = {f"{PREFIX[kind]}/step": row.get("step", 0), **scalars(row)}
        for tag, values in distributions(row).items():
            data[tag] = self.wandb.Histogram(values.tolist())
        self.run.log(data)

    def close(self) -> None:
        if self.events:
            self.run.log({"events": self.wandb.Table(columns=["time", "what", "detail"],
                                                     data=self.events)})
        self.run.finish()


class MlflowSink:
    """An MLflow run named after the laminar run: the config as flat params plus config.json,
    each row's numbers as metrics at its step. MLflow has no histograms: staleness becomes
    `train/staleness_hist/<k>` counts, environment latency its p50/p99. Events are written as
    the artifact events.txt at close."""

    def __init__(self, tracking_uri: str | None, run_name: str, config: dict[str, Any]) -> None:
        self.mlflow = _import("mlflow", "metrics.mlflow")
        if tracking_uri:
            self.mlflow.set_tracking_uri(tracking_uri)
        self.run = self.mlflow.start_run(run_name=run_name)
        self.mlflow.log_dict(config, "config.json")
        self.mlflow.log_params({k: str(v)[:250] for k, v in flatten(config).items()})
        self.events: list[str] = []

    def write(self, row: dict[str, Any]) -> None:
        kind = row.get("kind", "step")
        if kind == "event":
            self.events.append(f"{row.get('time', 0):.3f}s {event_text(row)}")
            return
        metrics = scalars(row)
        if kind == "step":
            for k, n in (row.get("staleness_hist") or {}).items():
                metrics[f"train/staleness_hist/{k}"] = float(n)
            for key in ("env_latency_s", "turns"):
                if row.get(key):
                    metrics[f"train/{key}/p50"] = float(np.percentile(row[key], 50))
                    metrics[f"train/{key}/p99"] = float(np.percentile(row[key], 99))
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}  # MLflow rejects NaN
        if metrics:
            self.mlflow.log_metrics(metrics, step=int(row.get("step", 0)))

    def close(self) -> None:
        if self.events:
            self.mlflow.log_text("\n".join(self.events) + "\n", "events.txt")
        self.mlflow.end_run()


def check_backends(cfg: MetricsConfig) -> None:
    """ConfigError now if a switched-on backend's package is missing (call it before starting
    a cluster, so the mistake costs no warm start)."""
    if cfg.wandb:
        _import("wandb", "metrics.wandb")
    if cfg.mlflow:
        _import("mlflow", "metrics.mlflow")


def open_sinks(cfg: MetricsConfig, run_dir: Path, run_name: str, config: dict[str, Any],
               start_time: float | None = None) -> list[Any]:
    """The sinks `cfg` enables, opened (a missing optional package raises ConfigError before
    any is opened). `config`: the run's whole config as a dict, recorded once by each.
    `start_time`: the run's start (unix seconds) that rows' `time` counts from; default now."""
    run_dir = Path(run_dir)
    check_backends(cfg)
    config = json.loads(json.dumps(config, default=str))  # plain types only (paths, tuples)
    sinks: list[Any] = []
    try:
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard", config, start_time))
        if cfg.wandb:
            sinks.append(WandbSink(cfg.wandb_project, run_dir, run_name, config))
        if cfg.mlflow:
            sinks.append(MlflowSink(cfg.mlflow_tracking_uri, run_name, config))
    except BaseException:
        for sink in sinks:  # e.g. W&B login failed: do not leave TensorBoard's writer open
            sink.close()
        raise
    return sinks
