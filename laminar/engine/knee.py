"""The knee of the engine's decode curve: Algorithm 1's batch bound B, measured on this machine.

    curve = decode_curve(model, batches=(1, 2, 4, ..., 256))   # {batch: median ms per step}
    knee(curve)                                                # -> B, an int
    cached_knee(model_cfg, threads)                            # .cache/engine-knee-*.json

The paper sets B where decode turns from memory-bound to compute-bound on the roofline (§5.2)
and gives no number. A roofline step costs `a + c·b` for b rows: `a` reads the weights once
per step, `c` is the work of one more row. The turn is where the two terms are equal,
b* = a / c: there a step costs twice a batch-1 step, doubling the batch raises the step's
latency by 1.5x (a third more tokens per second, where a doubling below the knee nearly
doubles them), and the throughput b / (a + c·b) is half its ceiling 1 / c. So:

    B = the batch at which the median decode step costs KNEE_FACTOR (2) x the batch-1 step,
        interpolated linearly between the measured powers of two (1 .. 256);
        the largest batch measured when no step reaches it (a flat curve: never compute-bound).

`laminar/sim/costs.py:roofline_batch` uses the same factor on its fitted line, so the
simulator and the runtime read B alike. On the CPU, steps are timed in CPU time of this
process (with one thread, the latency an idle core would give), so other jobs on a shared
machine slow the measurement little; on a GPU in wall time, the device synchronized around
each step (its host-side launches and the kernels both count): at each batch the median of 16
steps, the lowest of 3 rounds.

`cached_knee` keys the cache by the model (preset, or a hash of the model directory's
config.json), the device (this CPU, or the GPU's name) and the torch thread count; a missing
entry is measured (a few seconds for the presets) in a child process, so a caller that never
imports torch (the rollout manager) stays so. `python -m laminar.engine.knee --preset tiny
--threads 1 [--device cuda]` prints one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from laminar.provenance import cpu_model
from laminar.types import GenerationRequest, SamplingParams

KNEE_FACTOR = 2.0
BATCHES = tuple(2 ** k for k in range(9))  # 1 .. 256
STEPS = 16  # timed decode steps per batch size and round
ROUNDS = 3
CACHE_DIR = Path(".cache")


def knee(curve: dict[int, float], factor: float = KNEE_FACTOR) -> int:
    """The batch at which a step costs `factor` x the batch-1 step (linear interpolation
    between measured batches); the largest measured batch if none does."""
    pts = sorted((int(b), float(ms)) for b, ms in curve.items())
    if len(pts) < 2 or pts[0][0] != 1:
        raise ValueError(f"a decode curve needs batch 1 and at least one larger batch, got "
                         f"{[b for b, _ in pts]}")
    target = factor * pts[0][1]
    for (b0, ms0), (b1, ms1) in zip(pts, pts[1:]):
        if ms1 >= target:
            if ms1 == ms0:
                return b1
            return max(1, int(b0 + (b1 - b0) * (max(target, ms0) - ms0) / (ms1 - ms0)))
    return pts[-1][0]


def decode_curve(model: Any, batches: tuple[int, ...] = BATCHES, steps: int = STEPS,
                 rounds: int = ROUNDS) -> dict[int, float]:
    """ms of one decode step of the native engine at each batch size, every row decoding (CPU
    time on the CPU, wall time on a GPU: `step_clock`): the median of `steps` steps, in
    `rounds` rounds over all batch sizes, the lowest round kept (a round that another
    process's burst slowed is dropped). Contexts start at 12 prompt tokens and grow by one per
    step."""
    from laminar.engine.engine import Engine  # torch: only the measuring child process loads it

    clock = step_clock(next(model.parameters()).device)

    no_eos = model.config.vocab_size  # never sampled: every row decodes through the timing
    budget = rounds * steps + 8
    engines = {}
    for batch in batches:
        engine = Engine(model, no_eos, 0, max_batch_size=batch,
                        kv_capacity_tokens=batch * (12 + budget + 1))
        params = SamplingParams(temperature=1.0, max_new_tokens=budget)
        for i in range(batch):
            engine.add(GenerationRequest(f"k{i}", [1] + [10 + (i + j) % 60 for j in range(11)],
                                         params))
        for _ in range(4):  # the prefill step, then warm decode steps
            engine.step()
        engines[batch] = engine
    best = {b: float("inf") for b in batches}
    for _ in range(rounds):
        for batch, engine in engines.items():
            times = []
            for _ in range(steps):
                t0 = clock()
                engine.step()
                times.append(clock() - t0)
            best[batch] = min(best[batch], 1000 * statistics.median(times))
    return best


def step_clock(device: Any) -> Any:
    """The clock a step is timed by on `device`: this process's CPU time on the CPU; on a GPU
    the wall clock after synchronizing the device (a step's kernels run after its launches)."""
    if getattr(device, "type", str(device)) == "cpu":
        return time.process_time
    import torch

    def wall() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return wall


def device_name(device: str = "cpu") -> str:
    """What a measured curve belongs to: this CPU's model name, or the GPU's (`cuda`)."""
    if device == "cpu":
        return cpu_name()
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def model_key(preset: str, path: str | None) -> str:
    """The cache's name for a model: the preset, or the directory's name and a hash of its
    config.json (the architecture sets the curve, not the weights)."""
    if not path:
        return preset
    config = Path(path) / "config.json"
    digest = hashlib.sha256(config.read_bytes() if config.is_file() else path.encode()).hexdigest()
    return f"{_slug(Path(path).name)}-{digest[:10]}"


def cpu_name() -> str:
    """The CPU's model name (one definition: the benchmarks' provenance records the same)."""
    return cpu_model()


def cache_path(preset: str, path: str | None, threads: int, cache_dir: Path = CACHE_DIR,
               device: str = "cpu", name: str | None = None) -> Path:
    """The cache file of a curve; `name`: the device's (`device_name`), read when not given."""
    where = _slug(name or device_name(device))
    gpu = "" if device == "cpu" else "gpu-"  # a GPU's curve never reads as a CPU's
    return cache_dir / f"engine-knee-{model_key(preset, path)}-{gpu}{where}-{threads}t.json"


def cached_knee(preset: str, path: str | None, threads: int, cache_dir: Path = CACHE_DIR,
                device: str = "cpu") -> dict[str, Any]:
    """{"knee", "curve_ms", ...}: read from the cache, or measured now in a child process and
    written there. `device`: `cpu`, or `cuda` for the curve of a GPU of this machine."""
    file = cache_path(preset, path, threads, cache_dir, device)
    if file.is_file():
        return json.loads(file.read_text())
    cmd = [sys.executable, "-m", "laminar.engine.knee", "--preset", preset, "--threads",
           str(threads), "--out", str(file), "--device", device] + (["--path", path] if path else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the decode curve's knee for manager.batch_bound failed "
                           f"({' '.join(cmd)}):\n{done.stderr[-2000:]}\nset manager.batch_bound "
                           "to a trajectory count instead")
    return json.loads(file.read_text())


def measure(preset: str, path: str | None, threads: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    from laminar.models import build_preset, load_pretrained  # torch, transformers

    torch.set_num_threads(threads)
    model = (load_pretrained(path)[0] if path else build_preset(preset)).eval().to(device)
    t0 = time.perf_counter()
    curve = decode_curve(model)
    return {"knee": knee(curve), "knee_factor": KNEE_FACTOR,
            "curve_ms": {str(b): round(ms, 4) for b, ms in curve.items()},
            "model": model_key(preset, path), "cpu": cpu_name(), "threads": threads,
            "device": device, "device_name": device_name(device),
            "clock": "cpu time" if device == "cpu" else "wall, device synchronized",
            "torch": torch.__version__, "measured_s": round(time.perf_counter() - t0, 2),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:60]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Measure the decode curve's knee (Algorithm 1's B).")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--path", default=None, help="a Hugging Face model directory instead")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the JSON here (atomically)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the curve of this machine's GPU")
    args = ap.parse_args()
    result = measure(args.preset, args.path, args.threads, args.device)
    text = json.dumps(result, indent=1)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        tmp.write_text(text + "\n")
        os.replace(tmp, out)  # several processes may measure at once: the last one wins whole
    print(text)


if __name__ == "__main__":
    main()
