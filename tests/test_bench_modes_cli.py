"""`laminar bench modes`: its CPU accounting (which process is which component, a real meter) and
its options (bad ones fail before anything starts)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from laminar.bench.cpu import CpuMeter, component


def test_processes_are_grouped_by_component():
    assert component(["ray::RolloutActor.generate_groups()"], 10, 1) == "RolloutActor"
    assert component(["ray::TrainerActor"], 10, 1) == "TrainerActor"
    assert component(["/x/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=a"], 10, 1) == "ray daemons"
    assert component(["python", "train.py"], 1, 1) == "driver"
    assert component(["python", "something_else.py"], 10, 1) is None


def test_the_meter_counts_cpu_of_the_driver_and_not_of_strangers():
    stranger = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with CpuMeter(period_s=0.1) as meter:
            x = 0
            while meter.thread.is_alive() and x < 3_000_000:
                x += 1
    finally:
        stranger.kill()
    assert meter.seconds.get("driver", 0) > 0.05
    assert stranger.pid not in meter.last  # a busy process that is not part of the run
    assert meter.last[os.getpid()][0] == "driver"


def test_bench_modes_options_fail_early_with_a_clear_message(capsys):
    from laminar.cli import main

    assert main(["bench", "modes", "--set", "rollout.num_wrkers=4"]) == 2
    assert "num_wrkers" in capsys.readouterr().err
    assert main(["bench", "modes", "--modes", "laminar,verl"]) == 2
    assert "unknown verl" in capsys.readouterr().err
    assert main(["bench", "modes", "--modes", "sync,partial"]) == 2
    assert "laminar included" in capsys.readouterr().err
    assert main(["bench", "modes", "--task", "humaneval"]) == 2
    assert "has a workload for reverse, calc, reasoning_gym" in capsys.readouterr().err
    assert main(["bench", "modes", "--predicted", "/nonexistent/prediction.json"]) == 2
    assert "--predicted /nonexistent/prediction.json" in capsys.readouterr().err
    assert main(["bench", "engine", "--set", "rollout.num_workers=4"]) == 2
    assert "apply to `laminar bench modes` only" in capsys.readouterr().err
    assert main(["bench", "repack", "--modes", "laminar"]) == 2  # repack takes --set, not these
    assert "apply to `laminar bench modes` only, not to `repack`" in capsys.readouterr().err
    assert main(["bench", "repack", "--set", "rollout.num_wrkers=4"]) == 2
    assert "num_wrkers" in capsys.readouterr().err
    assert main(["bench", "relay", "--backend", "native,vllm"]) == 2
    assert "--backend, --model and --device apply to `laminar bench engine` only" in capsys.readouterr().err
    assert main(["bench", "engine", "--quick", "--model", "/nonexistent/model"]) == 2
    assert "--model '/nonexistent/model' is not a directory" in capsys.readouterr().err
    assert main(["bench", "engine", "--quick", "--backend", "native,sglang"]) == 2
    assert "--backend 'native,sglang'" in capsys.readouterr().err
    assert main(["bench", "engine", "--spec", "--backend", "vllm"]) == 2
    assert "--backend and --model do not apply to `laminar bench engine --spec`" in capsys.readouterr().err
    if not torch.cuda.is_available():  # before any model is built or trained
        assert main(["bench", "engine", "--spec", "--quick", "--device", "cuda"]) == 2
        assert "--device=cuda but this machine has no CUDA device" in capsys.readouterr().err


def test_partial_rollout_trains_with_decoupled_ppo_unless_told_otherwise(tmp_path):
    from laminar.bench.modes import bench_config

    algo = {m: bench_config(m, 1, tmp_path).trainer.correction.kind
            for m in ("laminar", "sync", "one_step", "stream", "partial")}
    assert algo == {"laminar": "none", "sync": "none", "one_step": "none",
                    "stream": "none", "partial": "decoupled"}
    same = bench_config("partial", 1, tmp_path, ["trainer.correction=none"])
    assert same.trainer.correction.kind == "none"  # --set wins: the schedules alone
    assert same.trainer.old_logprobs == "rollout"


def test_the_simulators_prediction_is_compared_as_laminar_over_mode_ratios():
    from laminar.bench.modes import compare_prediction

    out = compare_prediction({"laminar": 300.0, "sync": 100.0, "partial": 250.0},
                             {"sync": 2.4, "partial": 1.2, "trl": 5.0}, "pred.json")
    assert out["predicted_ratio_laminar_vs"] == {"sync": 3.0, "partial": 1.2}
    assert out["measured_ratio_laminar_vs"] == {"sync": 2.4, "partial": 1.2}
    assert abs(out["error"]["sync"] - (-0.2)) < 1e-9 and abs(out["error"]["partial"]) < 1e-9


def test_trl_runs_the_same_batch_and_optimizer_steps_in_each_of_its_settings(tmp_path):
    from laminar.bench.modes import bench_config
    from laminar.bench.trl import SETTINGS, trl_args

    cfg = bench_config("sync", 20, tmp_path)
    for setting in SETTINGS:
        args = trl_args(cfg, 20, tmp_path, setting)
        samples = cfg.trainer.prompts_per_step * cfg.rollout.group_size
        assert args["per_device_train_batch_size"] * args["steps_per_generation"] == samples
        assert args["max_steps"] == 20 * cfg.trainer.mini_batches and args["beta"] == 0.0
        assert args["learning_rate"] == cfg.trainer.lr
    assert "gradient_checkpointing" not in trl_args(cfg, 1, tmp_path, "defaults")  # TRL's own
    assert trl_args(cfg, 1, tmp_path, "no_checkpointing")["gradient_checkpointing"] is False
    assert trl_args(cfg, 1, tmp_path, "no_checkpointing_cb")["use_transformers_continuous_batching"]
