"""What the schedules share without Ray: the starting weights, and (for the one-process loop)
turning finished generation requests into scored trajectories."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from laminar.config import Config, ConfigError
from laminar.models.tokenizer import decode_response
from laminar.tasks import Task
from laminar.types import GenerationRequest, PromptGroup, Trajectory


def start_weights(cfg: Config) -> tuple[str, int]:
    """(model directory every component loads, its version): a resumed checkpoint, else
    `model.path`, else the cached SFT warm start, else a freshly initialised preset."""
    if cfg.trainer.resume:
        ckpt = Path(cfg.trainer.resume)
        if not (ckpt / "trainer_state.json").is_file() or not (ckpt / "model").is_dir():
            raise ConfigError(f"trainer.resume='{ckpt}' is not a laminar checkpoint (expected "
                              "model/ and trainer_state.json inside, e.g. runs/NAME/checkpoints/step_000010)")
        return str(ckpt / "model"), int(json.loads((ckpt / "trainer_state.json").read_text())["version"])
    if cfg.model.path:
        return cfg.model.path, 0
    from laminar.models import load_policy, save_pretrained

    if cfg.sft.enabled:
        from laminar.trainer.sft import run_sft

        return str(run_sft(cfg)), 0
    path = cfg.resolved_run_dir / "initial_model"
    save_pretrained(*load_policy(cfg.model), path)
    return str(path), 0


def to_trajectory(group: PromptGroup, req: GenerationRequest, task: Task,
                  tokenizer: PreTrainedTokenizerBase) -> tuple[Trajectory, str | None]:
    """Score a finished request; returns the trajectory and the reward error, if any."""
    scored = task.score(group.item, decode_response(tokenizer, req.output_ids))
    traj = Trajectory(traj_id=req.request_id, group_id=group.group_id, prompt_ids=req.prompt_ids,
                      response_ids=req.output_ids, logprobs=req.logprobs, version=req.version,
                      reward=scored.reward, exact_match=scored.exact_match,
                      finish_reason=req.finish_reason)
    return traj, scored.error


class Stopwatch:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt
