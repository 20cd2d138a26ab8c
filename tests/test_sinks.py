"""Metrics sinks: what TensorBoard's own reader finds in the event files equals metrics.jsonl;
W&B and MLflow map rows the same way (checked against stand-in modules, neither package is a
dependency) and say how to get them when they are switched on but missing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from laminar.config import ConfigError, MetricsConfig
from laminar.metrics import MetricsLogger, read_rows
from laminar.sinks import open_sinks, scalars

CONFIG = {"name": "t", "trainer": {"lr": 2e-4, "total_steps": 3}, "rollout": {"num_workers": 2}}


def step_row(step: int) -> dict[str, Any]:
    return {"version": step, "reward": 0.5 + step / 10, "exact_match": 0.25 * step,
            "loss": -0.01 * step, "response_len_p50": 6.0, "batch_tokens": 100 + step,
            "staleness_hist": {"0": 10, "1": step}, "update_interval_s": None if step == 1 else 1.5,
            "kv_util_by_rollout": {"rollout0": 0.5, "rollout1": 0.25 * step},
            "env_latency_s": [0.1, 0.2 * step], "mode_name": "laminar"}


def write_run(run_dir: Path, cfg: MetricsConfig) -> tuple[list[dict[str, Any]], float]:
    """Rows of every kind through MetricsLogger into `cfg`'s sinks; (metrics.jsonl, run start)."""
    sinks = open_sinks(cfg, run_dir, "t", CONFIG)
    logger = MetricsLogger(run_dir, 3, console=False, sinks=sinks)
    logger.write("eval", {"step": 0, "version": 0, "rollout": "rollout0", "greedy_exact_match": 0.1,
                          "greedy_reward": 0.4, "sampled_exact_match": 0.05, "sampled_reward": 0.3,
                          "num_prompts": 8, "eval_s": 0.2})
    for step in (1, 2):
        logger.log(step, step_row(step))
    logger.write("event", {"what": "repack", "detail": "moved 3 trajectories rollout0 -> rollout1"})
    logger.write("span", {"who": "rollout0", "what": "generate", "start": 0.0, "end": 0.1,
                          "version": 1})
    logger.log(3, step_row(3))
    logger.write("eval", {"step": 3, "version": 3, "rollout": "rollout1", "greedy_exact_match": 0.5,
                          "greedy_reward": 0.8, "sampled_exact_match": 0.4, "sampled_reward": 0.7,
                          "num_prompts": 8, "eval_s": 0.3})
    logger.close()
    return read_rows(run_dir), logger.t0


def test_tensorboard_events_equal_metrics_jsonl(tmp_path: Path) -> None:
    rows, t0 = write_run(tmp_path, MetricsConfig())
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0,
                                                                 "histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag, value in scalars(row).items():
            expected.setdefault(tag, []).append((row["step"], value))
    assert {"train/reward", "train/loss", "train/kv_util_by_rollout/rollout1",
            "heldout/greedy_exact_match", "heldout/num_prompts"} <= set(expected)
    assert tags == set(expected)  # nothing else: no spans, no strings, no axes
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), tag
    steps = {r["step"]: r for r in rows if r["kind"] == "step"}
    assert [e.value for e in acc.Scalars("train/reward")] == pytest.approx(
        [steps[s]["reward"] for s in (1, 2, 3)], rel=1e-6)
    assert "train/update_interval_s" in tags and len(acc.Scalars("train/update_interval_s")) == 2
    assert "train/mode_name" not in tags and "train/time" not in tags
    first = acc.Scalars("train/reward")[0]  # walltime: the run's start + the row's time
    assert first.wall_time == pytest.approx(t0 + steps[1]["time"], abs=0.05)

    hist = acc.Histograms("train/staleness_hist")
    assert [h.step for h in hist] == [1, 2, 3]
    assert [h.histogram_value.num for h in hist] == [11, 12, 13]
    assert [h.step for h in acc.Histograms("train/env_latency_s")] == [1, 2, 3]

    texts = {tag: acc.Tensors(tag) for tag in acc.Tags()["tensors"]}
    assert {"config/text_summary", "events/text_summary"} <= set(texts)
    event = texts["events/text_summary"][0]
    assert event.step == 2
    assert b"repack: moved 3 trajectories" in event.tensor_proto.string_val[0]
    assert b"lr: 0.0002" in texts["config/text_summary"][0].tensor_proto.string_val[0]


def test_tensorboard_off_writes_nothing(tmp_path: Path) -> None:
    assert open_sinks(MetricsConfig(tensorboard=False), tmp_path, "t", CONFIG) == []
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("key", ["wandb", "mlflow"])
def test_missing_backend_is_a_config_error_naming_the_key(tmp_path: Path, monkeypatch,
                                                          key: str) -> None:
    monkeypatch.setitem(sys.modules, key, None)  # import fails, whether or not it is installed
    with pytest.raises(ConfigError) as err:
        open_sinks(MetricsConfig(tensorboard=False, **{key: True}), tmp_path, "t", CONFIG)
    message = str(err.value)
    assert f"metrics.{key}" in message and f"pip install {key}" in message
    assert f"metrics.{key}=false" in message


class FakeBackend:
    """Stands in for a backend module (or its run object): records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self
        return call

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]


def test_wandb_sink_maps_rows_like_tensorboard(tmp_path: Path, monkeypatch) -> None:
    fake = FakeBackend()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    rows, _ = write_run(tmp_path, MetricsConfig(tensorboard=False, wandb=True, wandb_project="p"))
    ((_, init_kwargs),) = fake.named("init")
    assert init_kwargs["project"] == "p" and init_kwargs["name"] == "t"
    assert init_kwargs["config"] == CONFIG
    logged = [a[0] for a, _ in fake.named("log")]
    step_logs = [d for d in logged if "train/step" in d]
    assert [d["train/step"] for d in step_logs] == [1, 2, 3]
    step3 = next(r for r in rows if r.get("step") == 3 and r["kind"] == "step")
    assert {k: v for k, v in step_logs[-1].items() if k.startswith("train/") and k != "train/step"
            and "hist" not in k and "latency" not in k} == scalars(step3)
    assert [d["heldout/step"] for d in logged if "heldout/step" in d] == [0, 3]
    assert any("events" in d for d in logged)  # the table of events, at close
    assert fake.named("finish")


def test_mlflow_sink_maps_rows_at_their_steps(tmp_path: Path, monkeypatch) -> None:
    fake = FakeBackend()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    write_run(tmp_path, MetricsConfig(tensorboard=False, mlflow=True, mlflow_tracking_uri="file:x"))
    assert fake.named("set_tracking_uri")[0][0] == ("file:x",)
    params = fake.named("log_params")[0][0][0]
    assert params["trainer.lr"] == "0.0002" and params["rollout.num_workers"] == "2"
    metrics = fake.named("log_metrics")
    by_step = {k["step"]: a[0] for a, k in metrics if "train/reward" in a[0]}
    assert sorted(by_step) == [1, 2, 3]
    assert by_step[2]["train/staleness_hist/1"] == 2.0
    assert "train/env_latency_s/p99" in by_step[2]
    assert [k["step"] for a, k in metrics if "heldout/greedy_exact_match" in a[0]] == [0, 3]
    text, name = fake.named("log_text")[0][0]
    assert name == "events.txt" and "repack: moved 3" in text
    assert fake.named("end_run")


def test_scalars_skip_axes_strings_and_none() -> None:
    row = {"kind": "step", "time": 1.0, "step": 4, "a": None, "b": True, "c": "x", "d": [1, 2],
           "e": {"r0": 1, "r1": None}}
    assert scalars(row) == {"train/b": 1.0, "train/e/r0": 1.0}
    assert scalars({"kind": "span", "start": 1.0}) == {}
    assert scalars({"kind": "event", "what": "join"}) == {}


def test_whole_config_is_recorded_once(tmp_path: Path) -> None:
    from laminar.config import Config

    for sink in open_sinks(MetricsConfig(), tmp_path, "t", Config().model_dump()):  # tuples too
        sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (config,) = acc.Tensors("config/text_summary")
    text = config.tensor_proto.string_val[0].decode()
    assert "eval_every: 10" in text and "betas:" in text


def test_check_backends_before_anything_is_opened(monkeypatch) -> None:
    from laminar.sinks import check_backends

    check_backends(MetricsConfig())  # defaults need nothing optional
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match="metrics.mlflow"):
        check_backends(MetricsConfig(mlflow=True))
