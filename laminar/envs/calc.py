"""The environment of the built-in `calc` task (laminar/tasks/calc.py has the formats).

A turn holding a complete `<py>...</py>` tool call runs its code in the sandbox and shows the
output (`\\n<out>...</out>\\nA:`; an error, timeout or cut output shows the sandbox's message,
tail-truncated to 200 characters); any other turn is the final answer, scored by exact match.
A turn that opens `<py>` and never closes it (the token budget ran out) ends the episode with
reward 0. The state is plain data (the sandbox settings and the answer), so an episode pickles
and moves between rollouts; the sandbox itself is the process's shared pool.
"""

from __future__ import annotations

from laminar.config import SandboxConfig
from laminar.envs.base import Env, StepResult
from laminar.tasks.calc import TOOL_CLOSE, TOOL_OPEN, observation_text
from laminar.types import PromptItem


class CalcEnv(Env):
    stop = (TOOL_CLOSE,)

    def __init__(self, sandbox: SandboxConfig | None = None) -> None:
        self.sandbox = sandbox if sandbox is not None else SandboxConfig()
        self.answer = ""

    async def reset(self, sample: PromptItem) -> str:
        self.answer = sample.answer
        return sample.prompt

    async def step(self, text: str) -> StepResult:
        start = text.find(TOOL_OPEN)
        if start >= 0:
            end = text.find(TOOL_CLOSE, start + len(TOOL_OPEN))
            if end < 0:  # an unclosed tool call: the turn ran out of budget
                return StepResult("", 0.0, True, {"exact_match": False})
            from laminar.sandbox import shared_sandbox

            code = text[start + len(TOOL_OPEN):end]
            r = await shared_sandbox(self.sandbox).arun(code)
            return StepResult(observation_text(r.observation()), 0.0, False,
                              {"tool_s": r.wall_s, "tool_status": r.status})
        exact = text.strip() == self.answer
        return StepResult("", 1.0 if exact else 0.0, True, {"exact_match": exact})
