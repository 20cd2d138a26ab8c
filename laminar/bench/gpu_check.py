"""The prepared GPU check: one call on a machine with one NVIDIA GPU, one JSON with provenance.

    scripts/gpu-check.sh                       # installs the CUDA pieces, then runs this
    python -m laminar.bench.gpu_check [--device cuda|cpu] [--dry-run] [--out FILE]

Stages, each a subprocess with its own timeout, so one that fails or hangs is recorded (its
error, the tail of its output) and the others still run and the JSON is still written:
  model   build a 0.5B-shaped Qwen2 from config (hidden 896, 24 layers, 14 heads, 2 KV heads,
          intermediate 4864, laminar's char-tokenizer vocab; no download) and save it as a
          Hugging Face directory; `--device cpu` builds the same shape scaled down.
  engine  `laminar bench engine --backend native,vllm` (with `--model DIR` where the benchmark
          takes one): vLLM vs native tokens/s.
  relay   a relay process; the model's weights pushed from the device into it (device -> host,
          the trainer's push) and pulled back into device memory (`laminar.devices.stage_copy`
          through a pinned staging buffer, and plain `copy_` as the control): seconds per GB.
  job     a 20-step laminar job on vLLM (`rollout.engine.backend=vllm`) on that model: its
          throughput and the exactly-once check of its run report.
  spec    `laminar bench engine --spec --device cuda`: the native engine's speculative decoding
          and shared group prefixes on the GPU (issue 36's targets: speculation_gain and
          speculation_tail_speedup >= 1.5x, which a CPU cannot reach; docs/engine.md). Needs no
          model stage (the tiny preset's warm start, trained on the CPU if not cached).
`--stages` runs a subset (e.g. `--stages spec` on a short device lease; engine, relay and job
need model). `--dry-run` checks the plan here: it resolves every command and config, builds
the model config, runs the relay stage on the CPU with the scaled-down model and prints the
plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from laminar.bench.relay_node import RelayProcess
from laminar.cli import build_parser
from laminar.config import PRESET_POSITIONS, ConfigError, RelayConfig, load_config
from laminar.devices import StagingBuffer, resolve_device, stage_copy
from laminar.doctor import backend_rows, host_rows, torch_rows
from laminar.models import load_pretrained, save_pretrained
from laminar.models.builder import VOCAB_SIZE
from laminar.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer
from laminar.provenance import provenance
from laminar.relay.client import Puller, Pusher
from laminar.relay.plan import RelayInfo, build_chain

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results" / "gpu-check.json"
# Qwen2-0.5B's shape with laminar's vocabulary (models/builder.py VOCAB_SIZE)
SHAPES = {
    "cuda": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864),
    "cpu": dict(hidden_size=224, num_hidden_layers=4, num_attention_heads=14,
                num_key_value_heads=2, intermediate_size=1216),  # the same heads, scaled down
}
# 540 s in all for the first four (~8 min of runs); spec ~3 min (its warm start's SFT, ~1 min
# on one CPU thread, when .cache/sft does not hold it)
TIMEOUTS_S = {"model": 90, "engine": 150, "relay": 60, "job": 240, "spec": 300}
STAGES = tuple(TIMEOUTS_S)
BENCH_FILES = {"engine": "bench-engine.json", "spec": "bench-engine-spec.json"}  # in --work
NEEDS_MODEL = ("engine", "relay", "job")
SPEC_KEYS = ("speculation_gain", "speculation_tail_speedup", "acceptance_rate",
             "prefix_prefill_ratio", "prefix_long_prompt_gain")  # the spec stage's, in the summary
JOB_STEPS = 20


def model_config(device: str) -> Any:

    return Qwen2Config(vocab_size=VOCAB_SIZE, max_position_embeddings=PRESET_POSITIONS,
                       tie_word_embeddings=True, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                       eos_token_id=EOS_ID, **SHAPES[device])


def param_count(cfg: Any) -> int:
    """Parameters of a tied Qwen2 of this config, without building it."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    attn = h * h * 2 + h * kv * 2 + h + 2 * kv  # q, o; k, v; biases of q, k, v
    layer = attn + 3 * h * i + 2 * h
    return v * h + cfg.num_hidden_layers * layer + h


def build_model(device: str, out_dir: Path) -> dict[str, Any]:

    cfg = model_config(device)
    t0 = time.perf_counter()
    with torch.device("cuda" if device == "cuda" else "cpu"):  # initialise where it is fast
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    model = model.to("cpu")
    save_pretrained(model, build_char_tokenizer(), out_dir)
    n = sum(p.numel() for p in model.parameters())
    return {"path": str(out_dir), "params": n, "bytes_fp32": 4 * n, "shape": SHAPES[device],
            "vocab_size": cfg.vocab_size, "build_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------- relay stage


def relay_stage(model_dir: Path, device_setting: str, reps: int) -> dict[str, Any]:
    """Push the model from the device into a relay process, pull it back into device memory."""
    import uuid
    from dataclasses import asdict



    device = resolve_device(device_setting, "--device")
    source, _ = load_pretrained(model_dir)
    source = source.to(device)
    target, _ = load_pretrained(model_dir)
    target = target.to(device)
    dst = dict(target.named_parameters())
    named = {k: p.detach() for k, p in source.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    staging = StagingBuffer.for_device(device) or StagingBuffer.allocate(pin=False)
    cfg, secret = RelayConfig(), uuid.uuid4().hex.encode()
    push_s, pull_s, plain_s = [], [], []
    with tempfile.TemporaryDirectory(prefix="laminar-gpu-check-") as tmp:
        relay = RelayProcess("r0", f"gc{uuid.uuid4().hex[:6]}", secret, cfg, log_path=Path(tmp) / "relay.log")
        try:
            pusher = Pusher(build_chain([RelayInfo(**asdict(relay.info))]), secret, cfg)
            puller = Puller(relay.info, cfg)
            for k in range(reps + 1):  # round 0 warms up (page faults, pinning, CUDA context)
                with torch.no_grad():
                    for p in source.parameters():
                        p.add_(1.0 if k % 2 else -1.0)  # a new version: other bytes
                _sync(device)
                push = pusher.push(named, k + 1).seconds
                pulled = puller.open_latest(newer_than=k)
                assert pulled is not None and pulled.version == k + 1, "the version did not arrive"
                with pulled:
                    views = pulled.named_tensors()
                    t0 = time.perf_counter()
                    stage_copy(dst, views, staging)
                    _sync(device)
                    staged = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    stage_copy(dst, views, None)  # control: copy_ straight from shared memory
                    _sync(device)
                    plain = time.perf_counter() - t0
                    del views
                if k:
                    push_s.append(push)
                    pull_s.append(staged)
                    plain_s.append(plain)
            same = all(torch.equal(a, dst[n]) for n, a in named.items())
            pusher.close()
            puller.close()
        finally:
            relay.close()
    gb = nbytes / 1e9
    med = statistics.median
    return {"device": str(device), "bytes": nbytes, "reps": reps, "pinned": staging.pinned,
            "push_s": med(push_s), "pull_staged_s": med(pull_s), "pull_plain_s": med(plain_s),
            "push_s_per_gb": med(push_s) / gb, "pull_s_per_gb": med(pull_s) / gb,
            "pull_plain_s_per_gb": med(plain_s) / gb, "weights_equal": same,
            "runs": {"push_s": push_s, "pull_staged_s": pull_s, "pull_plain_s": plain_s}}


def _sync(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------- the plan


def laminar_cmd() -> list[str]:
    return [sys.executable, "-m", "laminar.cli"]


def engine_command(model_dir: Path, out: Path, device: str = "cuda") -> tuple[list[str], list[str]]:
    """`laminar bench engine --backend native,vllm ...` and what the plan lacks."""
    cmd = [*laminar_cmd(), "bench", "engine", "--backend", "native,vllm", "--quick", "--out", str(out)]
    problems = []
    help_text = _bench_help()
    if "--backend" not in help_text:
        problems.append("`laminar bench engine` has no --backend option yet")
    if "--device" in help_text:
        cmd += ["--device", device]  # the native engine on the GPU too, beside vLLM
    else:
        problems.append("`laminar bench engine` has no --device option: its native engine "
                        "runs on the CPU")
    if "--model" in help_text:
        cmd += ["--model", str(model_dir)]
    else:
        problems.append("`laminar bench engine` has no --model option: it measures its presets, "
                        "not the 0.5B-shaped model")
    return cmd, problems


def spec_command(out: Path, device: str = "cuda") -> list[str]:
    """`laminar bench engine --spec` on `device` (on the CPU the quick size: the full one is
    docs/results/bench-engine-spec.json's)."""
    return [*laminar_cmd(), "bench", "engine", "--spec", "--device", device, "--out", str(out),
            *(["--quick"] if device == "cpu" else [])]


def parse_stages(text: str | None) -> tuple[str, ...]:
    """`--stages a,b` -> the stages in plan order; every stage when not given."""
    if not text:
        return STAGES
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise SystemExit(f"gpu-check: --stages={text!r}: unknown stage(s) {unknown}; choose from "
                         f"{','.join(STAGES)}")
    if set(names) & set(NEEDS_MODEL) and "model" not in names:
        names.append("model")  # engine, relay and job measure the model stage's model
    return tuple(s for s in STAGES if s in names)


def _bench_help() -> str:
    """The options `laminar bench` takes (its parser, in this process)."""

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["bench"].format_help()


def job_overrides(model_dir: Path, run_dir: Path, device: str) -> list[str]:
    return [f"model.path={model_dir}", "name=gpu-check", f"run_dir={run_dir}", "mode=laminar",
            "rollout.engine.backend=vllm", f"rollout.device={device}", f"trainer.device={device}",
            f"trainer.total_steps={JOB_STEPS}", "trainer.prompts_per_step=8",
            "trainer.mini_batches=2", "trainer.checkpoint_every=0", "trainer.eval_every=0",
            "task.eval_prompts=16", "rollout.num_workers=1", "cluster.virtual_nodes=1",
            "durable_pools=true",
            # Ray hides GPUs from actors that ask for none: the trainer and the rollout share it
            *(["cluster.trainer_resources={GPU: 0.5}", "cluster.rollout_resources={GPU: 0.5}"]
              if device == "cuda" else [])]


def job_command(model_dir: Path, run_dir: Path, device: str) -> tuple[list[str], list[str]]:
    overrides = job_overrides(model_dir, run_dir, device)
    problems = []
    try:
        load_config(ROOT / "examples" / "reverse.yaml", overrides)
    except ConfigError as e:
        problems.append("the job's config does not load yet: " + " ".join(str(e).split()))
    return [*laminar_cmd(), "train", str(ROOT / "examples" / "reverse.yaml"), *overrides], problems


def job_result(run_dir: Path) -> dict[str, Any]:
    report = json.loads((run_dir / "report.json").read_text())
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "throughput_tokens_per_s" in row:
                rows.append(row)
    tput = [r["throughput_tokens_per_s"] for r in rows[2:] if r["throughput_tokens_per_s"]]
    return {"steps": len(rows), "exactly_once": report.get("exactly_once"),
            "throughput_tokens_per_s": statistics.median(tput) if tput else None,
            "engine_backend": next((r.get("engine_backend") for r in rows if r.get("engine_backend")), None),
            "logprob_abs_diff_p99": [r.get("logprob_abs_diff_p99") for r in rows
                                     if r.get("logprob_abs_diff_p99") is not None][-5:],
            "gen_tokens_per_s": report.get("gen_tokens_per_s")}


def run_stage(name: str, cmd: list[str], timeout_s: float, log_dir: Path) -> dict[str, Any]:
    """Run one stage's command; its outcome, never an exception."""
    t0 = time.perf_counter()
    log = log_dir / f"{name}.log"
    print(f"gpu-check: {name}: {shlex.join(cmd)} (timeout {timeout_s:.0f}s)", flush=True)
    try:
        with open(log, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ok, error = r.returncode == 0, None if r.returncode == 0 else f"exit code {r.returncode}"
    except subprocess.TimeoutExpired:
        ok, error = False, f"timed out after {timeout_s:.0f}s"
    except OSError as e:
        ok, error = False, f"{type(e).__name__}: {e}"
    out = {"ok": ok, "seconds": round(time.perf_counter() - t0, 2), "command": shlex.join(cmd)}
    if error:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        out |= {"error": error, "output_tail": tail}
        print(f"gpu-check: {name} FAILED ({error})\n{tail[-800:]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m laminar.bench.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="check the plan on this machine "
                    "(CPU, scaled-down model): resolve the commands, run the relay stage")
    ap.add_argument("--out", default=None, help=f"the JSON (default: {OUT.relative_to(ROOT)}; "
                    "with --dry-run or --device cpu: printed only, unless given)")
    ap.add_argument("--work", default=None, help="folder for the model, logs and the run")
    ap.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)} "
                    "(default: all; engine, relay and job bring model along)")
    ap.add_argument("--stage", choices=("model", "relay"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    device = "cpu" if a.dry_run else a.device
    stages = parse_stages(a.stages)
    if a.stage:  # one stage in this (child) process: write its result as JSON
        if a.stage == "model":
            result = build_model(device, Path(a.model_dir))
        else:
            result = relay_stage(Path(a.model_dir), device, a.reps or 3)
        Path(a.stage_out).write_text(json.dumps(result))
        return result


    work = Path(a.work or tempfile.mkdtemp(prefix="laminar-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, run_dir = work / "model", work / "run"
    started = time.perf_counter()
    cfg = model_config(device)
    result: dict[str, Any] = {
        "device": device, "dry_run": a.dry_run, "work": str(work),
        "model_config": {**SHAPES[device], "vocab_size": cfg.vocab_size,
                         "max_position_embeddings": cfg.max_position_embeddings,
                         "params": param_count(cfg)},
        "timeouts_s": TIMEOUTS_S, "stages": {}}
    try:  # what this machine is (the sandbox and Ray rows do not matter here)
        t_rows, build = torch_rows()
        rows = t_rows + host_rows() + backend_rows(build)
        result["doctor"] = {f"{r.section}.{r.name}": f"{r.status}: {r.detail}" for r in rows}
    except Exception as e:  # noqa: BLE001 - the check goes on without it
        result["doctor"] = {"error": f"{type(e).__name__}: {e}"}

    def child(stage: str, reps: int | None = None) -> list[str]:
        return [sys.executable, "-m", "laminar.bench.gpu_check", "--stage", stage, "--device", device,
                "--model-dir", str(model_dir), "--stage-out", str(work / f"{stage}.json"),
                *(["--reps", str(reps)] if reps else [])]

    engine_cmd, engine_problems = engine_command(model_dir, work / BENCH_FILES["engine"], device)
    job_cmd, job_problems = job_command(model_dir, run_dir, device)
    if device == "cpu":  # also the config the GPU run will use (it loads on any machine)
        job_problems += [f"(cuda) {p}" for p in job_command(model_dir, run_dir, "cuda")[1]]
    plan = {"model": child("model"), "engine": engine_cmd, "relay": child("relay", 2 if a.dry_run else 3),
            "job": job_cmd, "spec": spec_command(work / BENCH_FILES["spec"], device)}
    plan = {k: v for k, v in plan.items() if k in stages}
    result["plan"] = {k: shlex.join(v) for k, v in plan.items()}
    result["plan_problems"] = engine_problems + job_problems
    no_model = False
    for name, cmd in plan.items():
        if a.dry_run and name in ("engine", "job", "spec"):
            result["stages"][name] = {"ok": None, "skipped": "dry run: command resolved, not run"}
            continue
        if no_model and name in NEEDS_MODEL:
            result["stages"][name] = {"ok": False, "error": "no model (the model stage failed)"}
            continue
        stage = run_stage(name, cmd, TIMEOUTS_S[name], work)
        if stage["ok"] and name in ("model", "relay"):
            stage["result"] = json.loads((work / f"{name}.json").read_text())
        elif stage["ok"] and name in BENCH_FILES:
            stage["result"] = json.loads((work / BENCH_FILES[name]).read_text())
        elif name == "job" and (run_dir / "report.json").is_file():
            stage["result"] = job_result(run_dir)
            once = (stage["result"].get("exactly_once") or {}).get("ok")
            if stage["ok"] and once is not True:
                stage |= {"ok": False, "error": f"exactly-once check: {once}"}
        result["stages"][name] = stage
        no_model = no_model or (name == "model" and not stage["ok"])  # spec still runs
    result["summary"] = summarize(result["stages"])
    result["total_s"] = round(time.perf_counter() - started, 1)
    result["provenance"] = provenance({"device": device, "dry_run": a.dry_run, "job_steps": JOB_STEPS,
                                       "job_overrides": job_overrides(model_dir, run_dir, device)})
    text = json.dumps(result, indent=2, default=str)
    out = Path(a.out) if a.out else (None if (a.dry_run or device == "cpu") else OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print_plan(result, out)
    return result


def summarize(stages: dict[str, Any]) -> dict[str, Any]:
    """The numbers the issue asks for, None where a stage did not give them."""
    eng = (stages.get("engine") or {}).get("result") or {}
    backends = eng.get("backends") or {}
    tps = {k: (v.get("tokens_per_s") if isinstance(v, dict) else v) for k, v in backends.items()}
    ratio = (tps["vllm"] / tps["native"]) if tps.get("vllm") and tps.get("native") else None
    relay = (stages.get("relay") or {}).get("result") or {}
    job = (stages.get("job") or {}).get("result") or {}
    spec = (stages.get("spec") or {}).get("result") or {}
    return {"tokens_per_s": tps or None, "vllm_over_native": ratio,
            **{k: spec.get(k) for k in SPEC_KEYS},
            "push_s_per_gb": relay.get("push_s_per_gb"), "pull_s_per_gb": relay.get("pull_s_per_gb"),
            "pull_plain_s_per_gb": relay.get("pull_plain_s_per_gb"),
            "job_throughput_tokens_per_s": job.get("throughput_tokens_per_s"),
            "job_exactly_once": (job.get("exactly_once") or {}).get("ok"),
            "stages_ok": {k: v.get("ok") for k, v in stages.items()}}


def print_plan(result: dict[str, Any], out: Path | None) -> None:
    print(f"gpu-check ({'dry run, ' if result['dry_run'] else ''}device {result['device']}): "
          f"model {result['model_config']['params'] / 1e6:.0f}M parameters "
          f"({result['model_config']['hidden_size']} hidden, {result['model_config']['num_hidden_layers']} layers)")
    for name, cmd in result["plan"].items():
        stage = result["stages"].get(name, {})
        state = {True: "ok", False: "FAILED", None: "planned"}[stage.get("ok")]
        print(f"  {name:7} {state:8} {stage.get('seconds', ''):>7} {cmd}")
        if stage.get("error"):
            print(f"          {stage['error']}")
    for p in result["plan_problems"]:
        print(f"  plan: {p}")
    s = result["summary"]
    print(f"  relay: push {_f(s['push_s_per_gb'])} s/GB, pull {_f(s['pull_s_per_gb'])} s/GB staged "
          f"({_f(s['pull_plain_s_per_gb'])} s/GB plain copy_); vLLM/native {_f(s['vllm_over_native'])}; "
          f"job {_f(s['job_throughput_tokens_per_s'])} tok/s, exactly-once {s['job_exactly_once']}")
    print("  spec: " + ", ".join(f"{k} {_f(s[k])}" for k in SPEC_KEYS))
    print(f"  total {result['total_s']} s" + (f"; wrote {out}" if out else ""))


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def exit_code(result: dict[str, Any]) -> int:
    """0 when every stage that ran passed (a dry run: the model and relay stages)."""
    if "stages" not in result:  # a child stage: it got here, so it passed
        return 0
    return 0 if all(v.get("ok") is not False for v in result["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(exit_code(main()))
