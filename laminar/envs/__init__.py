"""Environments: multi-turn tasks whose episodes the framework runs token by token.

    from laminar.envs import Env, StepResult       # write your own (see base.py)
    task.env: my_envs.py:Calculator                # use it (with the task's prompts)

base.py is the API, episode.py the token loop shared by rollouts and evaluation, template.py
how observations become tokens. The built-in tasks' environments live with their tasks
(laminar/tasks/calc.py, laminar/tasks/humaneval.py).
"""

from laminar.envs.base import Env, RewardEnv, StepResult

__all__ = ["Env", "RewardEnv", "StepResult"]
