"""The `reasoning_gym` task: prompts, answers and scores from reasoning-gym's generators.

    task: {name: reasoning_gym, reasoning_gym: {datasets: [{name: spell_backward, weight: 1,
           config: {max_word_len: 5}}], size: 4096, seed: 0, template: "{question}\\n"}}

Parts: `load` (the optional package, or a one-line ConfigError naming the extra), `make_prompts`
(training and held-out prompts), `ReasoningGymEnv` (the one-turn environment that scores a
response) and `demonstration` (the SFT target: the generator's answer).

Prompts come from reasoning-gym's composite dataset: each item from one generator, chosen by
weight, with the sub-seeds the library derives (`seed + i + 1` for generator i, and item `k`
drawn from `Random(seed + k)`). The training set is `size` items from `seed`; the held-out set
comes from the seeds right after the training ones (no item's random draws are a training
item's), and a held-out question that a training item also asks is skipped, so a small question
space cannot leak training answers into the held-out score. The model sees `template` with
`{question}` replaced.

Scoring is the generator's own `score_answer(answer, entry)`, on the answer read from the
response: the last `<answer>...</answer>` when there is one (reasoning-gym's `extract_answer`,
for instruct models told to use the tags), else the whole response, stripped. A scorer that
raises on a malformed answer scores 0 (a wrong answer, not a failed trajectory). Held-out exact
match is a score of 1.

Why an environment rather than a reward function: `score_answer` needs the generator's entry
(its metadata), not only an answer string. The entry travels with its prompt as JSON in
`PromptItem.answer` (`oracle_answer` reads the answer back): rollouts cannot regenerate it,
because a few generators (isomorphic_strings, word_ladder, ...) iterate sets of strings, whose
order depends on each process's hash seed. Entries survive the JSON round trip with the same
scores (checked on 10 entries of each of 98 generators of reasoning-gym 0.1.25). The
scorer runs in a worker thread (`asyncio.to_thread`), so a slow one never blocks other episodes'
calls and is bounded by `task.env_timeout_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import functools
import json
import math
from typing import Any

from laminar.config import ConfigError, ReasoningGymTaskConfig
from laminar.envs.base import Env, StepResult
from laminar.types import PromptItem

MISSING = ("task.name=reasoning_gym needs the reasoning-gym package, which is not installed: "
           "pip install 'laminar[tasks]'")
HELDOUT_TRIES = 20  # held-out candidates drawn per prompt asked for before giving up


def load() -> Any:
    """The `reasoning_gym` module, or a ConfigError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(MISSING) from None
    return reasoning_gym


def _check_datasets(cfg: ReasoningGymTaskConfig) -> None:
    """A ConfigError naming `task.reasoning_gym.datasets[i]` for an unknown generator or a
    config its generator refuses."""
    rg = load()
    names = sorted(rg.factory.DATASETS)
    seen: set[str] = set()
    for i, ds in enumerate(cfg.datasets):
        key = f"task.reasoning_gym.datasets[{i}]"
        if ds.name not in rg.factory.DATASETS or ds.name == "composite":
            close = difflib.get_close_matches(ds.name, names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{key}.name='{ds.name}' is not a reasoning-gym generator; {hint}"
                              f"the {len(names)} generators: python -c \"import reasoning_gym; "
                              "print(sorted(reasoning_gym.factory.DATASETS))\"")
        if ds.name in seen:
            raise ConfigError(f"{key}.name='{ds.name}' is listed twice; give each generator once "
                              "(its weight sets its share)")
        seen.add(ds.name)
        for own in ("seed", "size"):
            if own in ds.config:
                raise ConfigError(f"{key}.config.{own}={ds.config[own]!r}: set "
                                  f"task.reasoning_gym.{own} instead (the held-out prompts are "
                                  "drawn from the seeds after the training ones)")
        config_cls = rg.factory.DATASETS[ds.name][1]
        try:
            rg.create_dataset(ds.name, **ds.config, seed=0, size=1)
        except TypeError as e:
            fields = ", ".join(f.name for f in dataclasses.fields(config_cls)
                               if f.name not in ("seed", "size"))
            raise ConfigError(f"{key}.config={ds.config!r} does not fit {config_cls.__name__} "
                              f"({e}); its keys: {fields}") from None
        except (AssertionError, ValueError) as e:
            raise ConfigError(f"{key}.config={ds.config!r} is refused by {ds.name}: "
                              f"{e or type(e).__name__}") from None


def _composite(cfg: ReasoningGymTaskConfig, size: int, seed: int) -> Any:
    rg = load()
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name=d.name, weight=d.weight, config=dict(d.config)) for d in cfg.datasets]
    return rg.create_dataset("composite", size=size, seed=seed, datasets=specs)


def heldout_seed(cfg: ReasoningGymTaskConfig) -> int:
    """The held-out composite's seed: its items' seeds (`seed + k`, and `seed + i + 1 + k` in
    generator i) all lie above every training item's."""
    return cfg.seed + cfg.size + len(cfg.datasets) + 1


def _item(index: int, entry: dict[str, Any], template: str) -> PromptItem:
    return PromptItem(index=index, prompt=template.replace("{question}", entry["question"]),
                      answer=json.dumps(entry, sort_keys=True))


def make_prompts(cfg: ReasoningGymTaskConfig, num_eval: int) -> tuple[list[PromptItem], list[PromptItem]]:
    """(`cfg.size` training prompts, `num_eval` held-out prompts none of which repeats a
    training question); deterministic given the config."""
    _check_datasets(cfg)
    train_set = _composite(cfg, cfg.size, cfg.seed)
    train = [_item(k, train_set[k], cfg.template) for k in range(cfg.size)]
    asked = {item.prompt for item in train}
    tries = HELDOUT_TRIES * num_eval
    candidates = _composite(cfg, tries, heldout_seed(cfg))
    held_out: list[PromptItem] = []
    for k in range(tries):
        item = _item(len(held_out), candidates[k], cfg.template)
        if item.prompt not in asked:
            asked.add(item.prompt)
            held_out.append(item)
            if len(held_out) == num_eval:
                return train, held_out
    raise ConfigError(f"task.eval_prompts={num_eval}: only {len(held_out)} of {tries} held-out "
                      f"questions are new (not among the task.reasoning_gym.size={cfg.size} "
                      "training ones nor repeated); the generators' question space is too small "
                      "for both: lower task.reasoning_gym.size or task.eval_prompts, or widen the "
                      "datasets' config")


def oracle_answer(item: PromptItem) -> str:
    """The generator's answer to an item's question."""
    return json.loads(item.answer)["answer"]


def demonstration(item: PromptItem) -> list[tuple[str, bool]]:
    """SFT: the prompt followed by the generator's answer (EOS follows, added by SFT)."""
    return [(oracle_answer(item), True)]


# ------------------------------------------------------------------------------ scoring


@functools.lru_cache(maxsize=8)
def _scorer(cfg_json: str) -> Any:
    """The composite dataset of a config, built once per process: its `score_answer`
    dispatches to the entry's generator, configured as the user configured it."""
    return _composite(ReasoningGymTaskConfig.model_validate_json(cfg_json), 1, 0)


def answer_text(response: str) -> str:
    """The answer in a response: the last <answer>...</answer>, else the whole of it."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response, tag_name="answer", strip=True)
    return tagged if tagged is not None else response.strip()


def score(cfg: ReasoningGymTaskConfig, response: str, reference: str) -> tuple[float, str | None]:
    """(the generator's score of the response in [0, 1], the scorer's error or None). A scorer
    that raises (on an answer it cannot parse) scores 0."""
    entry = json.loads(reference)
    try:
        value = float(_scorer(cfg.model_dump_json()).score_answer(answer_text(response), entry))
    except Exception as e:  # reasoning-gym's scorers raise on some malformed answers
        return 0.0, f"{type(e).__name__}: {e}"
    return (min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0), None


class ReasoningGymEnv(Env):
    """One turn: the question, the model's answer, the generator's score. State is plain data
    (the settings and the entry as JSON), so an episode pickles and moves between rollouts."""

    def __init__(self, cfg: ReasoningGymTaskConfig) -> None:
        self.cfg = cfg
        self.reference = ""

    async def reset(self, sample: PromptItem) -> str:
        self.reference = sample.answer
        return sample.prompt

    async def step(self, text: str) -> StepResult:
        value, error = await asyncio.to_thread(score, self.cfg, text, self.reference)
        info: dict[str, Any] = {"exact_match": value == 1.0}
        if error is not None:
            info["score_error"] = error
        return StepResult("", value, True, info)
