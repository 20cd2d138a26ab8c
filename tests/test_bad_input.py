"""Bad input at run time is one clear line, never a hang or a traceback: a cluster address
where nothing answers, a dataset with broken rows, a model.path that does not exist."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from laminar.config import ConfigError, load_config
from laminar.models.builder import load_pretrained
from laminar.modes import run_training


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_cluster_address_fails_fast_naming_it(tmp_path):
    address = f"127.0.0.1:{free_loopback_port()}"  # loopback, nothing listens
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "laminar.cli", "train", "examples/reverse.yaml",
         f"cluster.address={address}", "sft.enabled=false", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 30.0
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"cluster.address='{address}': nothing answers at {address}" in proc.stderr
    assert "unset cluster.address" in proc.stderr  # and the way out


def test_skipped_dataset_rows_are_reported_at_the_start_of_a_run(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([json.dumps({"prompt": "2+2=", "answer": "4"}), "{broken",
                               json.dumps({"prompt": "3+3="})]) + "\n")
    missing = tmp_path / "no-such-model"
    cfg = load_config(None, ["task.name=dataset", f"task.dataset.path={data}",
                             f"model.path={missing}", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as e:  # the missing model stops it right after the line
        run_training(cfg)
    out = capsys.readouterr().out
    assert f"{data}: 1 of 3 rows used; skipped 1 lines of broken JSON, 1 rows missing a field" in out
    assert str(e.value) == (f"model.path='{missing}' does not exist; point it at a local Hugging "
                            "Face model directory (config.json, weights and tokenizer files) or "
                            "unset it to start from model.preset")


def test_a_model_path_that_is_not_a_model_names_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path='.*' does not exist; point it at"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"is not a Hugging Face model directory \(no config.json"):
        load_pretrained(tmp_path)
