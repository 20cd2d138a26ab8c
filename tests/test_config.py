"""Config loading: every example parses; user mistakes get one clear message, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from laminar.config import Config, ConfigError, load_config

EXAMPLES = sorted(Path(__file__).resolve().parents[1].joinpath("examples").glob("*.yaml"))


def test_examples_exist():
    assert EXAMPLES, "examples/ should ship at least one config"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_every_field_has_a_description():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            sub = field.annotation
            for candidate in (sub, *getattr(sub, "__args__", ())):
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    walk(candidate, f"{prefix}{name}.")
    walk(Config)


def test_dotted_overrides_are_typed():
    cfg = load_config(EXAMPLES[0], ["trainer.lr=1e-4", "rollout.group_size=4", "task.reward=null",
                                    "trainer.betas=[0.8, 0.9]"])
    assert cfg.trainer.lr == 1e-4
    assert cfg.rollout.group_size == 4
    assert cfg.trainer.betas == (0.8, 0.9)


def test_unknown_key_names_the_key_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.lrr=1e-4"])
    msg = str(e.value)
    assert "unknown key 'trainer.lrr'" in msg
    assert "Did you mean 'lr'" in msg
    assert "Allowed keys in trainer:" in msg


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.group_size=many"])
    msg = str(e.value)
    assert "'rollout.group_size' = 'many'" in msg
    assert "valid integer" in msg


def test_bad_value_says_what_is_allowed():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.preset=huge"])
    assert "'model.preset' = 'huge'" in str(e.value)
    assert "'tiny' or 'small'" in str(e.value)
    with pytest.raises(ConfigError, match="greater than 0"):
        load_config(None, ["trainer.lr=-1"])


def test_impossible_combination_is_explained():
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=10 cannot hold"):
        load_config(None, ["rollout.max_new_tokens=10"])
    with pytest.raises(ConfigError, match="task.name=dataset needs"):
        load_config(None, ["task.name=dataset"])
    with pytest.raises(ConfigError, match=r"cluster.hang_timeout_s=5.0 must exceed cluster.heartbeat_s=10.0"):
        load_config(None, ["cluster.heartbeat_s=10", "cluster.hang_timeout_s=5"])


def test_retired_keys_name_their_replacement():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.max_staleness=2", "trainer.stream_minibatches=false"])
    msg = str(e.value)
    assert "'trainer.max_staleness' = 2: it was removed" in msg and "rollout.max_outstanding_batches" in msg
    assert "'trainer.stream_minibatches' = False: it was removed" in msg
    with pytest.raises(ConfigError, match="cluster.backend=local runs mode=sync"):
        load_config(None, ["cluster.backend=local", "mode=laminar"])
    with pytest.raises(ConfigError, match="needs rollout.engine.backend=native"):
        load_config(None, ["rollout.engine.backend=hf"])


def test_decoupled_moved_into_the_corrections_and_says_so():
    with pytest.raises(ConfigError, match="'trainer.old_logprobs': trainer.old_logprobs=decoupled "
                       "is now trainer.correction=decoupled"):
        load_config(None, ["trainer.old_logprobs=decoupled"])
    with pytest.raises(ConfigError, match="'trainer.behaviour_weight_cap' = 3: .*"
                       "trainer.correction=decoupled trainer.correction.cap=VALUE"):
        load_config(None, ["trainer.behaviour_weight_cap=3"])
    with pytest.raises(ConfigError, match="trainer.old_logprobs=rollout contradicts it"):
        load_config(None, ["trainer.correction=tis", "trainer.old_logprobs=rollout"])


def test_a_correction_by_name_takes_its_defaults_and_recomputes():
    cfg = load_config(None, ["trainer.correction=icepop"]).trainer
    assert (cfg.correction.kind, cfg.correction.low, cfg.correction.high) == ("icepop", 0.5, 5.0)
    assert cfg.old_logprobs == "recompute"
    cfg = load_config(None, ["trainer.correction.kind=tis", "trainer.correction.cap=3",
                             "trainer.correction.level=sequence"]).trainer
    assert (cfg.correction.cap, cfg.correction.level) == (3.0, "sequence")
    with pytest.raises(ConfigError, match="name the kind as a key: trainer.correction.kind=tis "
                       "trainer.correction.cap=3"):
        load_config(None, ["trainer.correction=tis", "trainer.correction.cap=3"])
    assert load_config(None).trainer.correction.kind == "none"
    assert load_config(None).trainer.old_logprobs == "rollout"


@pytest.mark.parametrize("overrides, key", [
    (["trainer.correction.kind=tis", "trainer.correction.cap=1"], "trainer.correction.cap=1.0 must be > 1"),
    (["trainer.correction.kind=decoupled", "trainer.correction.cap=0.5"], "trainer.correction.cap=0.5"),
    (["trainer.correction.kind=icepop", "trainer.correction.low=5"], "trainer.correction.low=5.0 and "
     "trainer.correction.high=5.0 (kind=icepop) are not a band"),
    (["trainer.correction.kind=mis", "trainer.correction.low=3", "trainer.correction.high=2"],
     "trainer.correction.low=3.0"),
    (["trainer.correction.kind=geo_mask", "trainer.correction.high=0.9"], "trainer.correction.high=0.9"),
    (["trainer.correction.kind=m2po", "trainer.correction.tau=0"], "trainer.correction.tau=0.0 must be > 0"),
    (["trainer.correction.kind=icepop", "trainer.correction.cap=2"], "trainer.correction.cap=2 is not a "
     "parameter of trainer.correction.kind=icepop"),
])
def test_a_correction_parameter_outside_its_meaning_is_one_error_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert msg.count("\n") == 1 and key in msg, msg


def test_an_older_runs_decoupled_ppo_resumes_as_the_decoupled_correction(tmp_path):
    saved = Config().model_dump(mode="json")
    saved["trainer"].pop("correction")
    saved["trainer"].update(old_logprobs="decoupled", behaviour_weight_cap=4.0)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = load_config(tmp_path / "config.yaml", saved_run=True).trainer
    assert (cfg.correction.kind, cfg.correction.cap, cfg.old_logprobs) == ("decoupled", 4.0, "recompute")
    saved["trainer"]["old_logprobs"] = "rollout"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = load_config(tmp_path / "config.yaml", saved_run=True).trainer
    assert cfg.correction.kind == "none" and cfg.old_logprobs == "rollout"


@pytest.mark.parametrize("old, value, new", [
    ("trainer.resume", "runs/a/checkpoints/step_000010", "trainer.from_checkpoint"),
    ("rollout.env_latency.enabled", "true", "bench.env_latency"),
])
def test_renamed_keys_name_old_key_value_and_replacement(old, value, new):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{old}={value}"])
    msg = str(e.value)
    assert msg.count("\n") == 1, msg  # the header and one line
    assert f"'{old.removesuffix('.enabled')}'" in msg and f"the key is now {new}" in msg and new in msg
    assert value in msg


def test_a_runs_saved_config_with_renamed_keys_still_resumes(tmp_path):
    """`laminar resume` of a run whose config.yaml an older laminar wrote (full dump, old keys)."""
    saved = Config().model_dump(mode="json")
    saved["trainer"]["resume"] = saved["trainer"].pop("from_checkpoint")
    saved["rollout"]["env_latency"] = {**saved.pop("bench")["env_latency"], "median_s": 0.25}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = load_config(tmp_path / "config.yaml", saved_run=True)
    assert cfg.bench.env_latency.median_s == 0.25 and cfg.trainer.from_checkpoint is None
    with pytest.raises(ConfigError, match="'trainer.resume' = None: the key is now trainer.from_checkpoint"):
        load_config(tmp_path / "config.yaml")  # a user's own file is told, not migrated


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="key.subkey=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such.yaml")


def test_cli_prints_one_message_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "laminar.cli", "train", str(EXAMPLES[0]),
                           "trainer.lrr=1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown key 'trainer.lrr'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_explain_prints_description_type_default_and_allowed_values():
    proc = subprocess.run([sys.executable, "-m", "laminar.cli", "config", "--explain",
                           "rollout.engine.backend"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "rollout.engine.backend" and "continuous-batching" in proc.stdout
    assert "  type:    str" in lines and "  default: 'native'" in lines
    assert "  allowed: 'native', 'vllm'" in lines


def test_config_explain_bounds_and_sections(capsys):
    from laminar.cli import main

    assert main(["config", "--explain", "trainer.lr"]) == 0
    out = capsys.readouterr().out
    assert "AdamW learning rate." in out and "type:    float (> 0.0)" in out
    assert "default: 0.0002" in out
    assert main(["config", "--explain", "trainer.lora"]) == 0
    assert "optional section (unset by default) with keys: r, alpha" in capsys.readouterr().out


def test_config_explain_unknown_key_is_one_line_with_close_matches(capsys):
    from laminar.cli import main

    assert main(["config", "--explain", "trainer.lrr"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'trainer.lrr'" in err and "'trainer.lr'" in err
    assert main(["config", "--explain", "seed"]) == 2  # the same leaf in several sections
    err = capsys.readouterr().err
    assert "'trainer.seed'" in err and "'task.seed'" in err
    assert main(["config", "--explain", "trainer.resume"]) == 2
    assert "is now trainer.from_checkpoint" in capsys.readouterr().err


def test_every_listed_key_explains(capsys):
    from laminar.cli import main
    from laminar.config.explain import every_key, explain

    assert main(["config"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "trainer.lr = 0.0002" in listed and len(listed) > 100
    for line in every_key().splitlines():
        assert explain(line.split(" = ")[0])
