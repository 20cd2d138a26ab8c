"""Tasks: the reverse task's long tail, the reward, datasets with bad rows, reward plugins."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from laminar.config import ConfigError, DatasetConfig, ReverseTaskConfig, TaskConfig
from laminar.tasks import build_task
from laminar.tasks.dataset import load_dataset
from laminar.tasks.reverse import make_prompts, sample_lengths
from laminar.tasks.rewards import exact_match, lcs_length, resolve_reward, score, similarity
from waiting import until


def test_lcs_and_similarity_by_hand():
    assert lcs_length("abcde", "ace") == 3
    assert lcs_length("abc", "") == 0
    assert similarity("abc", "abc") == 1.0
    assert similarity("", "") == 1.0
    assert similarity("abcd", "abdc") == pytest.approx(2 * 3 / 8)
    assert similarity("xyz", "abc") == 0.0
    assert exact_match(" cba \n", "cba")


def test_reverse_prompts_answer_is_the_reverse():
    items = make_prompts(ReverseTaskConfig(), 50, seed=1)
    for it in items:
        assert it.prompt.endswith("=")
        assert it.answer == it.prompt[:-1][::-1]
    assert [i.prompt for i in make_prompts(ReverseTaskConfig(), 50, seed=1)] == [i.prompt for i in items]


def test_default_lengths_are_long_tailed():
    lengths = sample_lengths(ReverseTaskConfig(), 20000, np.random.default_rng(0))
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p99 / p50 >= 8
    assert lengths.min() >= 1 and lengths.max() <= ReverseTaskConfig().max_len


def test_task_scores_and_reports_exact_match():
    task = build_task(TaskConfig(eval_prompts=8))
    item = task.train[0]
    assert task.score(item, item.answer).reward == 1.0
    assert task.score(item, item.answer).exact_match
    assert not task.score(item, item.answer + "x").exact_match
    assert len(task.eval) == 8


def test_jsonl_malformed_rows_are_counted_not_fatal(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([
        json.dumps({"question": "2+2=", "solution": "4"}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"question": "3+3="}),
        json.dumps({"question": 5, "solution": "x"}),
        json.dumps({"question": "1+1=", "solution": 2}),
        "",
    ]))
    items, report = load_dataset(DatasetConfig(path=str(path), prompt_column="question",
                                               answer_column="solution"))
    assert [(i.prompt, i.answer) for i in items] == [("2+2=", "4"), ("1+1=", "2")]
    assert report.total_rows == 6
    assert report.num_malformed == 4
    assert report.malformed["lines of broken JSON"] == 1
    assert "2 of 6 rows used" in report.summary()


def test_missing_column_is_a_clear_error(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"q": "a", "answer": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"task.dataset.prompt_column='prompt' is not a column .* q"):
        load_dataset(DatasetConfig(path=str(path)))


def test_parquet_rows_and_missing_column(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["ab=", None, "cd="], "answer": ["ba", "x", "dc"]}), path)
    items, report = load_dataset(DatasetConfig(path=str(path)))
    assert [i.answer for i in items] == ["ba", "dc"]
    assert report.num_malformed == 1
    with pytest.raises(ConfigError, match="answer_column='label'.*prompt, answer"):
        load_dataset(DatasetConfig(path=str(path), answer_column="label"))


def test_dataset_task_and_dotted_reward(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(5)))
    task = build_task(TaskConfig(name="dataset", dataset=DatasetConfig(path=str(path)),
                                 reward="laminar.tasks.rewards:similarity_reward", eval_prompts=3))
    assert len(task.train) == 5 and len(task.eval) == 3
    assert task.score(task.train[2], "2").reward == 1.0


def test_reward_plugin_errors():
    with pytest.raises(ConfigError, match="package.module:function"):
        resolve_reward("laminar.tasks.rewards.similarity")
    with pytest.raises(ConfigError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match="has no function"):
        resolve_reward("laminar.tasks.rewards:nope")
    with pytest.raises(ConfigError, match="must accept"):
        resolve_reward("laminar.tasks.rewards:lcs_length")


def test_a_failing_reward_scores_zero_with_an_error():
    def broken(prompt, response, answer):
        raise RuntimeError("sandbox flaked")

    assert score(broken, "p", "r", "a") == (0.0, "RuntimeError: sandbox flaked")
    assert score(lambda p, r, a: float("nan"), "p", "r", "a")[1] == "reward is not finite: nan"
    assert score(lambda p, r, a: 0.5, "p", "r", "a") == (0.5, None)


def test_a_dataset_beside_the_config_is_found_from_any_folder(tmp_path, monkeypatch):
    """task.dataset.path is read beside the YAML like the reward file (and saved absolute, so
    `laminar resume` finds it from anywhere); a path that is only under the folder laminar
    runs in is still taken from there; a missing one is left for the loader's error."""
    from laminar.config import load_config
    from laminar.tasks import build_task

    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job.mkdir()
    elsewhere.mkdir()
    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40))
    (job / "qs.jsonl").write_text(rows)
    (job / "job.yaml").write_text("task:\n  name: dataset\n  eval_prompts: 4\n"
                                  "  dataset: {path: qs.jsonl}\n")
    monkeypatch.chdir(elsewhere)
    cfg = load_config(job / "job.yaml")
    assert cfg.task.dataset.path == str(job / "qs.jsonl")
    assert len(build_task(cfg.task, cfg.sandbox).train) == 40
    (elsewhere / "here.jsonl").write_text(rows)
    (job / "job.yaml").write_text("task:\n  name: dataset\n  dataset: {path: here.jsonl}\n")
    assert load_config(job / "job.yaml").task.dataset.path == str(elsewhere / "here.jsonl")
    cfg = load_config(job / "job.yaml", ["task.dataset.path=nowhere.jsonl"])
    assert cfg.task.dataset.path == "nowhere.jsonl"


def test_a_reward_file_beside_the_config_is_found_from_any_folder(tmp_path, monkeypatch):
    from laminar.config import ConfigError, load_config
    from laminar.tasks.reward_pool import RewardPool
    from laminar.tasks.rewards import resolve_reward

    job = tmp_path / "job"
    job.mkdir()
    (job / "my_reward.py").write_text("def score(prompt, response, answer):\n"
                                      "    return 1.0 if response == answer else 0.25\n")
    (job / "job.yaml").write_text("task:\n  reward: my_reward.py:score\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(job / "job.yaml")
    assert cfg.task.reward == f"{job / 'my_reward.py'}:score"  # absolute: resume finds it too
    assert resolve_reward(cfg.task.reward)("p", "ab", "ab") == 1.0
    pool = RewardPool(cfg.task.reward, 1, timeout_s=30.0, retries=0)  # a fresh interpreter
    try:
        call = pool.submit("p", "ab", "ba")
        until("the reward call", lambda: call.done, poll_s=0.01)
        assert call.failed is None and call.reward == 0.25
    finally:
        pool.close()
    (elsewhere / "other.py").write_text("def score(p, r, a):\n    return 0.5\n")
    cfg = load_config(job / "job.yaml", ["task.reward=other.py:score"])  # relative to here
    assert resolve_reward(cfg.task.reward)("p", "r", "a") == 0.5
    with pytest.raises(ConfigError, match="no file"):
        resolve_reward(f"{job / 'missing.py'}:score")
