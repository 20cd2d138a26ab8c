"""The trainer service with real pools (no Ray): a diverged run stops with a checkpoint and a
clear error; a restart rewinds exactly what its checkpoint lacks."""

from __future__ import annotations

import json

import pytest

from laminar.config import RunStopped, load_config
from laminar.models import load_policy, save_pretrained
from laminar.pools.experience import ExperienceBuffer
from laminar.pools.prompts import PromptPool, PromptSampler
from laminar.rollout.io import WeightBoard
from laminar.runtime.local import BoardPush, LocalTrainerData
from laminar.trainer.service import TrainerService, newest_checkpoint
from laminar.types import PromptItem, Trajectory


def _service(tmp_path, *overrides):
    cfg = load_config(None, ["model.preset=tiny", "trainer.prompts_per_step=1", "trainer.threads=1",
                             "rollout.group_size=2", "trainer.max_nonfinite_steps=2",
                             "trainer.checkpoint_every=2", f"run_dir={tmp_path}", *overrides])
    save_pretrained(*load_policy(cfg.model), tmp_path / "model")
    prompts = PromptPool(PromptSampler([PromptItem(0, "ab=", "ba")], lambda s: [1, 2], 2))
    buffer = ExperienceBuffer(2)
    return cfg, buffer, TrainerService(cfg, str(tmp_path / "model"),
                                       LocalTrainerData(prompts, buffer), BoardPush(WeightBoard()))


def _group(gid, nan=False):
    trajs = [Trajectory(f"{gid}/{i}", gid, [1, 5, 6], [7 + i, 8, 2], [-1.0, -1.0, -1.0], 0,
                        reward=float(i)) for i in range(2)]
    if nan:
        trajs[1].logprobs[0] = float("nan")
    return trajs


def test_a_diverged_run_stops_with_a_checkpoint_and_a_clear_error(tmp_path):
    cfg, buffer, service = _service(tmp_path)
    buffer.put_many(_group("g0"))
    service.train_once()
    for i in range(1, 3):
        buffer.put_many(_group(f"g{i}", nan=True))
    service.train_once()  # skipped (1 in a row): the version still advances
    with pytest.raises(RunStopped) as stopped:
        service.train_once()  # 2 in a row: stop
    message = str(stopped.value)
    assert "2 optimizer updates in a row" in message and "laminar resume" in message
    ckpt = newest_checkpoint(tmp_path)
    assert ckpt is not None and str(ckpt) in message  # no update of this batch was applied
    assert json.loads((ckpt / "trainer_state.json").read_text())["steps"] == service.steps == 2
    # resuming from it gives back exactly the batch that diverged (taken at its version)
    assert buffer.rewind(service.trainer.version) == 1


def test_the_audit_is_written_before_the_checkpoint_that_holds_it(tmp_path):
    cfg, buffer, service = _service(tmp_path)
    for i in range(2):
        buffer.put_many(_group(f"g{i}"))
        service.train_once()
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 4 and newest_checkpoint(tmp_path).name == "step_000002"
    assert buffer.counts()["taken_groups"] == 0  # acknowledged by the checkpoint at 2


class DiesAfterPushing(BoardPush):
    """The push completes at the relay, then the trainer process dies (before anything else)."""

    def push(self, named, version):
        super().push(named, version)
        raise SystemExit("killed right after the master relay completed the version")


def test_a_version_number_is_never_reused_after_a_kill_right_after_its_push(tmp_path):
    """Under load a trainer was killed after the master relay had completed version N but before
    N was recorded as published; restarted, it numbered on from N - 1 and pushed other weights
    as N, a number the relays held already. The number is recorded before the push now."""
    cfg, buffer, service = _service(tmp_path)
    board = WeightBoard()
    service.weights = DiesAfterPushing(board)
    buffer.put_many(_group("g0"))
    with pytest.raises(SystemExit):
        service.train_once()
    assert board.version == 1
    restarted = TrainerService(cfg, str(tmp_path / "model"), service.data, BoardPush(board),
                               restarted=True)
    assert restarted.trainer.version == 1  # numbers on after version 1: its next push is 2
    assert restarted.steps == 0  # the update of version 1 is lost: no step counted
    # its weights are the checkpoint's (none yet: the start's), not version 1's: an update on
    # version-1 samples compares no log-probs with them; the next one's weights are 2's
    assert not restarted.trainer.weights_are_version
    for version in (1, 2):
        group = _group(f"v{version}")
        for t in group:
            t.version = version
        stats = restarted.trainer.train_step(group)
        assert restarted.steps == version  # one step per update, the skipped number not one
        if version == 1:
            assert stats["logprob_abs_diff_mean"] is None and stats["logprob_abs_diff_p99"] is None
        else:  # the recorded -1.0 are not the model's: a large mismatch
            assert stats["logprob_abs_diff_mean"] > 0.1 and stats["logprob_abs_diff_p99"] > 0.1


def test_a_stop_between_mini_batches_finishes_the_global_batch(tmp_path):
    """A stop that arrives after the first mini-batch of a global batch trained: the global
    batch still finishes (one version, every group recorded once). It used to end the run with
    that mini-batch's groups consumed and in the weights but in no step (seen: the audit of a
    LoRA job counted 2 groups more than steps x prompts_per_step)."""
    import threading

    cfg, buffer, service = _service(tmp_path, "trainer.prompts_per_step=2", "trainer.mini_batches=2")
    buffer.put_many(_group("g0"))
    second = threading.Timer(0.5, lambda: buffer.put_many(_group("g1")))
    trained = service.trainer.train_minibatch

    def then_stop(trajs):  # the stop arrives while the first mini-batch trains
        trained(trajs)
        if not service.stop_event.is_set():
            service.stop()
            second.start()

    service.trainer.train_minibatch = then_stop
    assert service.run(total_steps=5) == 1  # the global batch of g0 and g1, then the stop
    lines = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert sorted({t["group_id"] for t in lines}) == ["g0", "g1"]
    assert service.trainer.version == 1
