"""Held-out evaluation inside a rollout loop, and the timeline it records: the real engine on
the tiny model, the in-process doors, no Ray."""

from __future__ import annotations

import copy

from laminar.engine import Engine
from laminar.models import EOS_ID, PAD_ID
from laminar.rollout.evals import EvalJob, Evaluator
from laminar.rollout.requests import sampling_params
from laminar.rollout.timeline import Timeline
from laminar.tasks.evaluate import evaluate

from harness import World, step_until
from test_rollout_loop import CFG


def with_evaluator(world: World, mode: str = "laminar"):
    loop = world.loop()
    # as engine_factory does: a fresh engine on the starting weights (the world's model, v0)
    loop.evaluator = Evaluator(lambda: Engine(copy.deepcopy(world.model), EOS_ID, PAD_ID,
                                              max_batch_size=8, version=0),
                               world.tokenizer, world.task)
    return loop


def job(world: World, step: int, at_least: int, n: int = 6) -> EvalJob:
    return EvalJob(f"step{step}", step, at_least, world.task.eval[:n], sampling_params(CFG))


def test_greedy_half_matches_the_offline_evaluation_of_the_same_weights():
    world = World(CFG, "laminar")
    world.publish(0, seed=0)
    loop = with_evaluator(world)
    loop.request_eval(job(world, 0, 0))
    results: list = []
    step_until(loop, lambda: results.extend(loop.take_records()["evals"]) or results)
    [r] = results
    assert (r["step"], r["version"], r["num_prompts"]) == (0, 0, 6)
    offline = evaluate(Engine(copy.deepcopy(world.model), EOS_ID, PAD_ID), world.tokenizer,
                       type(world.task)(world.task.name, [], world.task.eval[:6], world.task.reward_fn),
                       CFG.rollout.max_new_tokens)
    assert r["greedy_exact_match"] == offline["eval_exact_match"]
    assert abs(r["greedy_reward"] - offline["eval_reward"]) < 1e-9
    assert 0.0 <= r["sampled_reward"] <= 1.0


def test_eval_waits_for_its_version_and_runs_on_it_while_the_loop_generates():
    world = World(CFG, "laminar")
    world.publish(0, seed=0)
    loop = with_evaluator(world)
    loop.request_eval(job(world, 3, at_least=3))
    for _ in range(50):
        loop.step()
    assert loop.take_records()["evals"] == []  # version 3 is not there yet
    assert loop.counters.generated_tokens > 0  # generation went on meanwhile
    world.publish(3, seed=1)
    results: list = []
    step_until(loop, lambda: results.extend(loop.take_records()["evals"]) or results)
    assert results[0]["version"] == 3
    # the schedule's engine is untouched by the evaluator's weights: it pulls on its own terms
    assert loop.evaluator.engine is not loop.engine


def test_same_weights_give_the_same_scores_twice():
    world = World(CFG, "sync")
    world.publish(0, seed=0)
    loop = with_evaluator(world, "sync")
    loop.request_eval(job(world, 0, 0))
    loop.request_eval(job(world, 1, 0))
    results: list = []
    step_until(loop, lambda: results.extend(loop.take_records()["evals"]) or len(results) == 2)
    a, b = results
    keys = ("greedy_exact_match", "greedy_reward", "sampled_exact_match", "sampled_reward")
    assert [a[k] for k in keys] == [b[k] for k in keys]  # fixed seeds: only weights change scores


def test_timeline_folds_short_states_and_adds_measured_spans():
    tl = Timeline(min_s=0.02)
    tl.mark("generate", 1, now=0.0)
    tl.mark("idle", 1, now=1.0)
    tl.mark("generate", 1, now=1.005)  # a 5 ms nap: folded into the span before
    tl.mark("idle", 1, now=2.0)
    tl.add("pull", 2.5, 2.6, 2)
    tl.mark("generate", 2, now=3.0)
    spans = [(s.what, s.start, s.end, s.version) for s in tl.take()]
    assert spans == [("generate", 0.0, 2.0, 1),  # the nap folded in, the span went on
                     ("idle", 2.0, 2.5, 1), ("pull", 2.5, 2.6, 2), ("idle", 2.6, 3.0, 1)]
    assert tl.take() == []


def test_loop_records_spans_and_pulls():
    world = World(CFG, "laminar")
    world.publish(0, seed=0)
    loop = world.loop()
    loop.timeline = Timeline(min_s=0.0)  # the tiny model decodes a batch in a few ms
    step_until(loop, lambda: loop.counters.generated_tokens > 20)
    world.publish(2, seed=1)
    step_until(loop, lambda: loop.engine.version == 2)
    spans = loop.take_records(close=True)["spans"]
    whats = [s.what for s in spans]
    assert "generate" in whats and "pull" in whats
    pull = next(s for s in spans if s.what == "pull")
    assert pull.version == 2 and pull.end >= pull.start
    assert all(a.end <= b.start + 1e-6 for a, b in zip(spans, spans[1:]))  # ordered, no overlap


def test_a_hanging_user_reward_cannot_stall_an_evaluation(tmp_path, monkeypatch):
    from laminar.tasks.reward_pool import RewardPool

    (tmp_path / "stuck_reward.py").write_text("import time\n\ndef reward(p, r, a):\n"
                                              "    time.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    world = World(CFG, "laminar")
    world.publish(0, seed=0)
    loop = with_evaluator(world)
    loop.evaluator.rewards = pool = RewardPool("stuck_reward:reward", 2, timeout_s=1.0, retries=0)
    try:
        loop.request_eval(job(world, 0, 0, n=2))
        results: list = []
        step_until(loop, lambda: results.extend(loop.take_records()["evals"]) or results)
    finally:
        pool.close()
    [r] = results  # it finished: each call was killed at its timeout and scored 0
    assert r["greedy_reward"] == 0.0 and r["sampled_reward"] == 0.0 and r["num_prompts"] == 2


def test_the_engine_factory_builds_fresh_engines_of_the_backend_on_the_starting_weights(tmp_path):
    """What the evaluator builds its engine with (rollout/build.py): never a copy of another
    engine, always the run's starting weights, stamped with the starting version."""
    import pytest

    from laminar.config import ConfigError
    from laminar.engine.protocol import RolloutEngine
    from laminar.models import save_pretrained
    from laminar.models.tokenizer import encode_prompt
    from laminar.rollout.build import engine_factory
    from laminar.types import GenerationRequest, SamplingParams

    world = World(CFG, "laminar")
    save_pretrained(world.model, world.tokenizer, tmp_path)
    make = engine_factory(CFG, str(tmp_path), world.tokenizer, version=3, seed=0)
    a, b = make(), make()
    assert a is not b and isinstance(a, RolloutEngine) and a.version == b.version == 3
    prompt = encode_prompt(world.tokenizer, world.task.eval[0].prompt)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=7)
    reference = Engine(copy.deepcopy(world.model), EOS_ID, PAD_ID)
    outs = [e.generate([GenerationRequest("g", list(prompt), greedy)])[0].output_ids
            for e in (a, b, reference)]
    assert outs[0] == outs[1] == outs[2]
    cfg = CFG.model_copy(deep=True)
    cfg.rollout.engine = cfg.rollout.engine.model_copy(update={"backend": "hf"})
    with pytest.raises(ConfigError, match="backend='hf'"):
        engine_factory(cfg, str(tmp_path), world.tokenizer, 0, 0)()
