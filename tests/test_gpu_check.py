"""The prepared GPU check (scripts/gpu-check.sh, laminar/bench/gpu_check.py) without a GPU: the
dry run that checks its plan on the CPU, the 0.5B shape, and a stage that fails or hangs being
recorded rather than ending the check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laminar.bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-check")
    out = work / "gpu-check.json"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--work",
                        str(work), "--out", str(out)], capture_output=True, text=True, timeout=280,
                       cwd=ROOT, env={**__import__("os").environ, "VENV": str(Path(sys.executable).parents[1])})
    return r, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.slow  # 15-20 s: builds the scaled-down model and runs the relay stage on the CPU
def test_dry_run_checks_the_plan_and_writes_one_json(dry_run):
    r, result = dry_run
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert result is not None and result["dry_run"] and result["device"] == "cpu"
    assert set(result["plan"]) == {"model", "engine", "relay", "job", "spec"}
    assert "bench engine --backend native,vllm" in result["plan"]["engine"]
    assert "bench engine --spec --device cpu" in result["plan"]["spec"]  # cuda on the GPU
    job = result["plan"]["job"]
    for key in ("rollout.engine.backend=vllm", "trainer.total_steps=20", "model.path="):
        assert key in job
    # the stages that need the GPU and vLLM are resolved, not run; the others ran here
    assert all(result["stages"][s]["ok"] is None for s in ("engine", "job", "spec"))
    assert result["stages"]["model"]["ok"] and result["stages"]["relay"]["ok"], result["stages"]
    relay = result["stages"]["relay"]["result"]
    assert relay["weights_equal"] and relay["device"] == "cpu" and relay["bytes"] > 0
    assert result["summary"]["pull_s_per_gb"] > 0 and result["summary"]["push_s_per_gb"] > 0
    prov = result["provenance"]
    assert prov["versions"]["torch"] and "commit" in prov and prov["config"]["job_steps"] == 20
    assert "gpu-check (dry run, device cpu)" in r.stdout


def test_the_half_billion_shape():
    """Qwen2-0.5B's layout with laminar's vocabulary, counted without building the weights."""
    cfg = gpu_check.model_config("cuda")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size) == (896, 24, 14, 2, 4864)
    from laminar.models.builder import VOCAB_SIZE
    from transformers import Qwen2ForCausalLM

    assert cfg.vocab_size == VOCAB_SIZE
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    assert gpu_check.param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert 0.3e9 < gpu_check.param_count(cfg) < 0.5e9
    small = gpu_check.model_config("cpu")
    with torch.device("meta"):
        assert gpu_check.param_count(small) == sum(p.numel() for p in Qwen2ForCausalLM(small).parameters())


def test_a_failing_or_hanging_stage_is_recorded(tmp_path):
    bad = gpu_check.run_stage("x", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                              30, tmp_path)
    assert bad["ok"] is False and bad["error"] == "exit code 3" and "boom" in bad["output_tail"]
    hung = gpu_check.run_stage("y", [sys.executable, "-c", "import time; time.sleep(30)"], 1, tmp_path)
    assert hung["ok"] is False and "timed out" in hung["error"]
    s = gpu_check.summarize({"engine": bad, "relay": hung})
    assert s["vllm_over_native"] is None and s["stages_ok"] == {"engine": False, "relay": False}
    assert gpu_check.exit_code({"stages": {"a": {"ok": True}, "b": {"ok": None}}}) == 0
    assert gpu_check.exit_code({"stages": {"a": {"ok": False}}}) == 1


def test_stages_are_chosen_in_plan_order_and_bring_the_model_they_measure():
    assert gpu_check.parse_stages(None) == gpu_check.STAGES
    assert gpu_check.parse_stages("spec") == ("spec",)  # the tiny preset: no model stage
    assert gpu_check.parse_stages("job, spec") == ("model", "job", "spec")
    with pytest.raises(SystemExit, match="unknown stage.*'engin'.*choose from model,engine"):
        gpu_check.parse_stages("engin")
    cmd = gpu_check.spec_command(Path("/w/s.json"), "cuda")
    assert cmd[-7:] == ["bench", "engine", "--spec", "--device", "cuda", "--out", "/w/s.json"]
    assert gpu_check.spec_command(Path("/w/s.json"), "cpu")[-1] == "--quick"


def test_summary_reads_the_benchmark_keys():
    stages = {"engine": {"ok": True, "result": {"backends": {"native": {"tokens_per_s": 100.0},
                                                             "vllm": {"tokens_per_s": 450.0}}}},
              "job": {"ok": True, "result": {"throughput_tokens_per_s": 900.0,
                                             "exactly_once": {"ok": True}}}}
    stages["spec"] = {"ok": True, "result": {"speculation_gain": 1.7, "acceptance_rate": 0.5}}
    s = gpu_check.summarize(stages)
    assert s["vllm_over_native"] == 4.5 and s["job_exactly_once"] is True
    assert s["speculation_gain"] == 1.7 and s["speculation_tail_speedup"] is None
    assert s["job_throughput_tokens_per_s"] == 900.0
