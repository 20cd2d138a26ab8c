"""The results index: a row per JSON with provenance, older JSONs listed by name."""

import json

import pytest

from laminar.provenance import provenance
from laminar.bench.results import headline, main, write_index
from laminar.cli import main as cli_main

RELAY = {"headline_size": "256MiB", "chain_ratio_p8_p2": 1.07, "star_over_chain_p8": 6.68,
         "push_stall_ratio_p8_p2": 1.68, "pull_over_memcpy": 1.15,
         "chain_over_model_by_p": {"2": 0.97, "4": 1.0, "8": 1.01}}


def _write(path, data):
    path.write_text(json.dumps(data))


def test_index_rows_and_older_results(tmp_path):
    p = provenance({"quick": False}, command="laminar bench relay --out bench-relay.json")
    _write(tmp_path / "bench-relay.json", {**RELAY, "provenance": p})
    _write(tmp_path / "old-modes.json", {"ratio_laminar_vs": {"sync": 3.4}})
    index = write_index(tmp_path).read_text()

    row = next(line for line in index.splitlines() if line.startswith("| [bench-relay.json]"))
    assert "chain p8/p2 1.07x" in row and "star/chain p8 6.68x" in row
    assert "`laminar bench relay --out bench-relay.json`" in row
    assert p["cpu"] in row and f"{p['cores']} cores" in row
    assert p["date"][:10] in row
    if p["commit"]:
        assert p["commit"][:7] in row
    older = index.split("## Older results (no provenance)")[1]
    assert "old-modes.json" in older and "bench-relay.json" not in older
    assert index.count("| [") == 1  # the old one is not a table row


def test_headline_of_each_kind():
    engine = {"ratio_native_vs_static": 4.67, "presets": {"tiny": {
        "ratio_native_vs_static": 4.67, "native_tokens_per_s": 7649, "static_tokens_per_s": 1640,
        "ratio_native_vs_static_cpu": 5.36, "ideal_ratio": 4.71}}}
    assert "tiny: native vs static 4.67x tokens/s (7,649 vs 1,640" in headline(engine)
    assert "chain/model p2 0.97, p4 1.00, p8 1.01" in headline(RELAY)
    sim = {"fidelity": {"fit_points": 32, "fit_within_25pct": 32, "heldout_points": 28,
                        "heldout_within_25pct": 24, "fitted_constants": {"count": 13},
                        "heldout_worst_error": {"ratio": "72b @ 512 laminar/sync",
                                                "error": 0.3777}}}
    assert headline(sim) == ("held out: 24 of 28 ratios within ±25%, worst 72b @ 512 "
                             "laminar/sync +38%; fitted: 32 of 32; 13 constants fitted")
    modes = {"ratio_laminar_vs": {"sync": 3.42, "trl": 5.73},
             "control_env_latency_off": {"ratio_laminar_vs": {"sync": 1.8}},
             "heldout_start": 0.31, "heldout_target": 0.452,
             "time_to_heldout_target_s_by_mode": {"laminar": 61.4, "partial": None}}
    assert headline(modes) == ("laminar vs sync 3.42x, trl 5.73x; env latency off: sync 1.80x; "
                               "held-out start 0.310, target 0.452; time to held-out target: "
                               "laminar 61 s, partial never")
    assert headline({"something": 1}) == "—"


def test_laminar_bench_index_writes_the_folder_of_out(tmp_path, capsys):
    _write(tmp_path / "r.json", {**RELAY, "provenance": provenance(command="x")})
    out = tmp_path / "README.md"
    assert cli_main(["bench", "index", "--out", str(out)]) == 0
    assert "| [r.json](r.json) |" in out.read_text()
    assert f"wrote {out}" in capsys.readouterr().out


def test_empty_folder_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no \\*.json"):
        main(out=str(tmp_path / "README.md"))
