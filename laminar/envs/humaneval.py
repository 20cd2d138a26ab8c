"""The environment of the `humaneval` task (laminar/tasks/humaneval.py has the formats).

One turn: the problem's prompt, the model's completion, then the completion's test program
(the whole problem, the completion, the problem's tests, `check(entry_point)`) runs in the
sandbox, never in the rollout's process: no network, no host files, rlimits, and
`sandbox.timeout_s` for a completion that loops forever. Reward 1 when every test passed, else
0; held-out exact match is that pass, so the greedy held-out exact match is pass@1. The step's
info carries the sandbox's status (`tool_status`, counted in the step rows' `tool_calls`) and
its error when a test failed. State is plain data (the settings and a task id), so an episode
pickles and moves between rollouts; the sandbox is the process's shared pool.
"""

from __future__ import annotations

import secrets

from laminar.config import HumanEvalTaskConfig, SandboxConfig
from laminar.envs.base import Env, StepResult
from laminar.tasks import humaneval
from laminar.types import PromptItem


class HumanEvalEnv(Env):
    stop = humaneval.COMPLETION_STOPS  # completion style; the task sets the style's own

    def __init__(self, cfg: HumanEvalTaskConfig | None = None,
                 sandbox: SandboxConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else HumanEvalTaskConfig()
        self.sandbox = sandbox if sandbox is not None else SandboxConfig()
        self.task_id = ""

    async def reset(self, sample: PromptItem) -> str:
        humaneval.problem(sample.answer)  # an unknown task id fails here, not in the sandbox
        self.task_id = sample.answer
        return sample.prompt

    async def step(self, text: str) -> StepResult:
        from laminar.sandbox import shared_sandbox

        token = secrets.token_hex(16)
        r = await shared_sandbox(self.sandbox).arun(humaneval.program(self.task_id, text, token))
        passed = r.ok and r.stdout.rstrip().endswith(token)
        info = {"exact_match": passed, "tool_status": r.status, "tool_s": r.wall_s}
        if not passed:
            info["error"] = r.error or "exited before the tests ran"
        return StepResult("", 1.0 if passed else 0.0, True, info)
