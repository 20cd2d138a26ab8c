"""provenance(): the record every benchmark JSON carries (commit, date, versions, machine)."""

import datetime
import json
import subprocess
import sys

from laminar import provenance as prov
from laminar.provenance import command_line, git_commit, provenance


def test_record_has_every_key_and_is_json():
    p = provenance({"steps": 3}, command="laminar bench engine --out e.json")
    assert set(p) == {"commit", "dirty", "date", "versions", "cpu", "cores", "machine",
                      "command", "config"}
    assert p["config"] == {"steps": 3}
    assert p["command"] == "laminar bench engine --out e.json"
    assert datetime.datetime.fromisoformat(p["date"]).utcoffset() == datetime.timedelta(0)
    assert p["cpu"] and p["cores"] >= 1 and p["machine"]
    json.dumps(p)


def test_versions_name_every_library():
    v = prov.versions()
    assert v["python"].count(".") == 2
    assert v["torch"] and v["numpy"]  # installed in the test environment
    assert set(prov.OPTIONAL) <= set(v)  # present as keys, None when not installed


def test_versions_do_not_import_heavy_modules():
    code = ("import sys; from laminar.provenance import provenance; provenance(); "
            "print(any(m in sys.modules for m in ('torch', 'transformers', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_git_commit_clean_dirty_and_absent(tmp_path):
    assert git_commit(tmp_path) == (None, None)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    (tmp_path / "untracked.txt").write_text("ignored by the dirty flag")
    head, dirty = git_commit(tmp_path)
    assert len(head) == 40 and dirty is False
    (tmp_path / "a.txt").write_text("2")
    assert git_commit(tmp_path) == (head, True)


def test_command_line_as_a_reader_would_retype_it():
    assert command_line(["/x/.venv/bin/laminar", "bench", "relay", "--quick"]) == \
        "laminar bench relay --quick"
    script = str(prov._CHECKOUT / "laminar" / "bench" / "results.py")
    assert command_line([script, "docs/results"]) == "python -m laminar.bench.results docs/results"
    assert command_line(["/usr/bin/tool", "-v"]) == "tool -v"
    assert command_line([]) == ""
