"""`laminar report`: the HTML page of one run, of several overlaid and of bench modes results,
from rows written with MetricsLogger and from a real tiny run; bad input is a ConfigError; and
headless Chromium opens the page (file:// only) with every figure decoded and no console line."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from laminar import report_plots
from laminar.config import ConfigError
from laminar.metrics import MetricsLogger
from laminar.report import CHECK
from laminar.report import main as report

# the tiny local run of tests/test_local_sync.py
SMALL = ["cluster.backend=local", "sft.enabled=false", "task.reverse.max_len=8",
         "rollout.max_new_tokens=9", "rollout.group_size=4", "trainer.prompts_per_step=4",
         "task.eval_prompts=8", "trainer.threads=1", "trainer.lr=1e-3"]
FULL = ["Held-out score", "Training reward", "Throughput", "Staleness",
        "Off-policy: mismatch and importance ratios", "KV-cache utilisation",
        "Environment latency", "Timeline"]


def fake_run(run_dir: Path, mode: str = "laminar", steps: int = 12, kinds: bool = True) -> Path:
    """A run's rows of all four kinds (or, `kinds=False`, step rows only and without `kind`,
    as an older run wrote them), two rollouts and a trainer, written by MetricsLogger."""
    log = MetricsLogger(run_dir, steps, console=False)
    rng = np.random.default_rng(len(mode))
    for step in range(1, steps + 1):
        t = 2.0 * step
        row = {"step": step, "time": t, "version": step, "mode": mode, "reward": 0.1 + 0.05 * step,
               "exact_match": 0.02 * step, "batch_tokens": 500,
               "throughput_tokens_per_s": None if step == 1 else 250.0 + rng.normal(0, 5),
               "gen_tokens_per_s": 400.0 + rng.normal(0, 9),
               "staleness_hist": {"0": 10, "1": 5, "2": 1}, "kv_util_mean": 0.5}
        if kinds:
            row |= {"logprob_abs_diff_all_p99": 0.3 + 0.02 * step, "logprob_abs_diff_p99": 2e-6,
                    "is_ratio_p99": 1.2 + 0.01 * step, "correction_masked": 0.01}
            row |= {"kv_util_by_rollout": {"rollout0": 0.4 + 0.01 * step, "rollout1": 0.6},
                    "gen_tokens_per_s_by_rollout": {"rollout0": 190.0, "rollout1": 210.0},
                    "env_latency_s": list(rng.lognormal(np.log(0.15), 1.0, 16))}
            for r in ("rollout0", "rollout1"):
                log.write("span", {"time": t, "who": r, "what": "generate", "start": t - 2.0,
                                   "end": t - 0.3, "version": step - 1})
                log.write("span", {"time": t, "who": r, "what": "pull", "start": t - 0.3,
                                   "end": t, "version": step})
            log.write("span", {"time": t, "who": "trainer", "what": "wait", "start": t - 2.0,
                               "end": t - 1.0, "version": None})
            log.write("span", {"time": t, "who": "trainer", "what": "train", "start": t - 1.0,
                               "end": t - 0.1, "version": step})
            log.write("span", {"time": t, "who": "trainer", "what": "push", "start": t - 0.1,
                               "end": t, "version": step})
            if step % 4 == 0 or step == 1:
                log.write("eval", {"time": t, "step": 0 if step == 1 else step, "version": step,
                                   "rollout": "rollout0", "greedy_exact_match": 0.05 * step,
                                   "greedy_reward": 0.06 * step, "sampled_exact_match": 0.03 * step,
                                   "sampled_reward": 0.04 * step, "num_prompts": 8, "eval_s": 0.2})
            if step == 7:
                log.write("event", {"time": t, "what": "repack", "detail": "moved 3 trajectories"})
        if kinds:
            log.log(step, row)
        else:
            with log.path.open("a") as f:
                f.write(json.dumps({k: v for k, v in row.items() if k != "mode"}) + "\n")
    log.close()
    return run_dir


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the report draws: per axes, how many artists hold data, and the legend
    texts; then the real PNG encoding."""
    figures: list[dict] = []
    encode = report_plots.encode_png

    def capture(fig):
        axes = []
        for ax in fig.axes:
            lines = [ln for ln in ax.get_lines() if np.isfinite(np.asarray(ln.get_ydata(), float)).any()]
            bars = [p for p in ax.patches  # a bar or histogram outline with an area
                    if np.ptp(p.get_patch_transform().transform(p.get_path().vertices),
                              axis=0).prod() > 0]
            axes.append({"data": len(lines) + len(bars) + len(ax.collections),
                         "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel()})
        legends = [t.get_text() for lg in [*fig.legends, *(a.get_legend() for a in fig.axes)]
                   if lg is not None for t in lg.get_texts()]
        figures.append({"title": fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title(),
                        "axes": axes, "legend": legends})
        return encode(fig)

    monkeypatch.setattr(report_plots, "encode_png", capture)
    return figures


def sections(page: str) -> dict[str, dict]:
    """Section title -> its PNGs and notes, from report.html."""
    out = {}
    for title, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", page, re.S):
        out[title] = {"png": re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", body),
                      "note": re.findall(r"<div class='note'>(.*?)</div>", body)}
    return out


def not_blank(png: bytes) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    return bool((pixels.min(axis=2) < 0.9).mean() > 0.01 and pixels.std() > 0.05)


def test_every_figure_of_a_full_run(tmp_path, drawn):
    run = fake_run(tmp_path / "run")
    summary = report(str(run))
    page = (run / "report.html").read_text()
    assert summary["html"] == str(run / "report.html") and (run / "report.png").stat().st_size > 0
    found = sections(page)
    assert list(found) == FULL
    for title, sec in found.items():
        assert len(sec["png"]) == 1 and not sec["note"], title
        assert not_blank(base64.b64decode(sec["png"][0])), title
    for fig in drawn:
        for ax in fig["axes"]:
            assert ax["data"] > 0 and ax["xlabel"], fig["title"]
    assert "0.05 → 0.60" in page  # held-out greedy exact match, first → last eval row
    assert "http://" not in page and "https://" not in page and "<link" not in page
    assert "moved 3 trajectories" in page  # the events table
    assert any("event: repack" in fig["legend"] for fig in drawn)


def test_an_old_run_gets_notes_not_empty_plots(tmp_path, drawn):
    run = fake_run(tmp_path / "old", kinds=False)
    report(str(run))
    found = sections((run / "report.html").read_text())
    for title in ("Held-out score", "Environment latency", "Timeline"):
        assert not found[title]["png"] and found[title]["note"], title
    for title in ("Training reward", "Throughput", "Staleness", "KV-cache utilisation"):
        assert len(found[title]["png"]) == 1, title
    assert "kv_util_by_rollout" in found["KV-cache utilisation"]["note"][0]  # the mean instead
    assert all(ax["data"] > 0 for fig in drawn for ax in fig["axes"])


def test_two_runs_share_the_axes(tmp_path, drawn, capsys):
    a = fake_run(tmp_path / "runs" / "a", mode="laminar")
    b = fake_run(tmp_path / "runs" / "b", mode="sync", steps=8)
    result = report([str(a), str(b)])
    dest = tmp_path / "runs" / "report.html"
    assert result["html"] == str(dest) and str(dest) in capsys.readouterr().out
    assert set(result["runs"]) == {"laminar", "sync"}  # the modes name the runs
    found = sections(dest.read_text())
    assert {"Timeline — laminar", "Timeline — sync"} <= set(found)
    reward = next(f for f in drawn if f["title"].startswith("training reward"))
    assert {"laminar · mean reward", "sync · mean reward"} <= set(reward["legend"])
    out = tmp_path / "elsewhere.html"
    report([str(a), str(b)], out=str(out))
    assert out.is_file()


def test_bench_modes_results_page(tmp_path, drawn):
    results = {"steps": 8, "throughput_by_mode": {"laminar": 900.0, "sync": 300.0, "trl": 100.0},
               "ratio_laminar_vs": {"sync": 3.0, "trl": 9.0}, "target_reward": 0.3,
               "reward_curve_by_mode": {"laminar": [[0, 0.1], [5, 0.3]], "sync": [[0, 0.1], [9, 0.3]]},
               "time_to_target_s_by_mode": {"laminar": 5.0, "sync": 9.0, "trl": None}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert report(str(path))["html"] == str(tmp_path / "results.html")
    found = sections((tmp_path / "results.html").read_text())
    assert len(found["Throughput per schedule"]["png"]) == 1
    bars = drawn[0]["axes"][0]
    assert bars["data"] == 3 and bars["ylabel"] == "training throughput (tokens/s)"
    results |= {"heldout_by_mode": {"laminar": [[0, 0, 0.4], [5, 8, 0.5]], "sync": [[0, 0, 0.4], [9, 8, 0.5]]},
                "heldout_target": 0.49, "time_to_heldout_target_s_by_mode": {"laminar": 5.0, "sync": 9.0}}
    path.write_text(json.dumps(results))  # a result with held-out curves: they lead
    report(str(path))
    page_text = (tmp_path / "results.html").read_text()
    assert "Held-out score vs time" in sections(page_text) and "time to held-out target" in page_text
    path.write_text(json.dumps({"workload": []}))
    with pytest.raises(ConfigError, match="throughput_by_mode"):
        report(str(path))


def test_bad_input_is_a_config_error(tmp_path, capsys):
    from laminar.cli import main as cli

    with pytest.raises(ConfigError, match="missing' does not exist; pass a run directory"):
        report(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        report(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no trainer-step rows"):
        report(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n{"kind": "st\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl' line 2 is not a JSON object"):
        report(str(tmp_path))
    assert cli(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("laminar: ") and "\n" not in err


def test_report_of_a_real_run(tmp_path):
    from laminar.config import load_config
    from laminar.modes import run_training

    cfg = load_config("examples/reverse-sync.yaml",
                      SMALL + [f"run_dir={tmp_path}", "trainer.total_steps=3"])
    run_training(cfg)
    summary = report(str(tmp_path))
    assert summary["steps"] == 3
    found = sections((tmp_path / "report.html").read_text())
    for title in ("Training reward", "Throughput", "Staleness", "KV-cache utilisation"):
        assert len(found[title]["png"]) == 1, title
        assert not_blank(base64.b64decode(found[title]["png"][0])), title
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = {r.get("kind", "step") for r in rows}
    assert ("eval" in kinds) == bool(found["Held-out score"]["png"])
    assert ("span" in kinds) == bool(found["Timeline"]["png"])


CHROMIUM = "/usr/bin/chromium"
OFFLINE = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--enable-logging=stderr", "--v=0"]


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on a file:// page with every network path switched off."""
    return subprocess.run([CHROMIUM, *OFFLINE, f"--user-data-dir={profile}", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def console_lines(stderr: str) -> list[str]:
    """The page's console output in Chromium's log (our page logs nothing at all)."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


@pytest.mark.skipif(not shutil.which(CHROMIUM),
                    reason="headless check needs Chromium: apt-get install -y chromium")
def test_chromium_renders_the_report(tmp_path):
    # the checker itself catches what it should: a console error, an image that fails
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><img class='figure' src='missing.png'><p id='figure-check'></p>"
                   "<script>console.error('boom')</script>" + CHECK
                   + "</body></html>")
    seen = chromium(bad, tmp_path / "profile", "--dump-dom")
    assert console_lines(seen.stderr) and 'data-loaded="0"' in seen.stdout

    run = fake_run(tmp_path / "runs" / "full")
    fake_run(tmp_path / "runs" / "old", mode="sync", kinds=False)
    report([str(run)])
    report([str(run), str(tmp_path / "runs" / "old")])
    for page in (run / "report.html", tmp_path / "runs" / "report.html"):
        dom = chromium(page, tmp_path / "profile", "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        loaded = re.search(r'id="figure-check" data-loaded="(\d+)" data-total="(\d+)"', dom.stdout)
        assert loaded and int(loaded[1]) == int(loaded[2]) > 5, page
        assert not console_lines(dom.stderr), console_lines(dom.stderr)
        shot = tmp_path / f"{page.parent.name}.png"
        done = chromium(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1400,5200",
                        "--hide-scrollbars")
        assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
        assert not_blank(shot.read_bytes()) and not console_lines(done.stderr)
