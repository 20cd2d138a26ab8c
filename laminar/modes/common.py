"""The starting weights every schedule's components load."""

from __future__ import annotations

import json
from pathlib import Path
from laminar.config import Config, ConfigError
from laminar.engine.lora import base_dir, is_lora_checkpoint_model
from laminar.models import load_policy, save_pretrained
from laminar.models.builder import check_model_dir
from laminar.pools.resume import check_resumable
from laminar.trainer.service import newest_checkpoint
from laminar.trainer.sft import run_sft


def start_weights(cfg: Config) -> tuple[str, int]:
    """(model directory every component loads, its version): the run's newest checkpoint when
    the job resumes (`resume`), else a checkpoint to start from (`trainer.from_checkpoint`), else
    `model.path`, else the cached SFT warm start, else a freshly initialised preset. With
    trainer.lora the LoRA base is checked too (`check_lora_start`)."""
    path, version = _start_weights(cfg)
    check_lora_start(cfg, path)
    return path, version


def check_lora_start(cfg: Config, path: str) -> None:
    """trainer.lora keeps one base for a run's whole lineage: the starting weights of a fresh
    run; a resumed one's `model/` is a merged export whose checkpoint names the base
    (laminar/engine/lora.py `base_dir`). A ConfigError when that cannot hold."""
    lora_ckpt = is_lora_checkpoint_model(path)
    resuming = bool(cfg.resume or cfg.trainer.from_checkpoint) and Path(path).name == "model"
    if cfg.trainer.lora is None:
        if lora_ckpt and resuming:
            raise ConfigError(f"the checkpoint {Path(path).parent} holds LoRA adapters; resume it "
                              "with its trainer.lora settings (its trainer_state.json has them)")
        return
    if lora_ckpt and not resuming:
        raise ConfigError(f"model.path={path} is the merged export of a LoRA checkpoint; to go on "
                          f"with its adapters set trainer.from_checkpoint={Path(path).parent}, to "
                          "train new adapters on its merged weights copy the folder out of the "
                          "checkpoint and point model.path at the copy")
    if lora_ckpt and cfg.cluster.address:
        raise ConfigError(f"resuming a trainer.lora run on a cluster (cluster.address="
                          f"{cfg.cluster.address}) is not supported yet: rollouts on other nodes "
                          "get the checkpoint's merged weights but not the run's LoRA base; "
                          "resume it on one machine (unset cluster.address)")
    base_dir(path)  # the base of a resumed run must still be there


def _start_weights(cfg: Config) -> tuple[str, int]:
    if cfg.resume:
        check_resumable(cfg)
        ckpt = newest_checkpoint(cfg.resolved_run_dir)
        if ckpt is not None:
            return str(ckpt / "model"), int(json.loads((ckpt / "trainer_state.json").read_text())["version"])
    if cfg.trainer.from_checkpoint:
        ckpt = Path(cfg.trainer.from_checkpoint)
        if not (ckpt / "trainer_state.json").is_file() or not (ckpt / "model").is_dir():
            raise ConfigError(f"trainer.from_checkpoint='{ckpt}' is not a laminar checkpoint (expected "
                              "model/ and trainer_state.json inside, e.g. runs/NAME/checkpoints/step_000010)")
        return str(ckpt / "model"), int(json.loads((ckpt / "trainer_state.json").read_text())["version"])
    if cfg.model.path:
        check_model_dir(cfg.model.path)  # here, not as a traceback from every component
        return cfg.model.path, 0
    if cfg.sft.enabled:
        return str(run_sft(cfg)), 0
    path = cfg.resolved_run_dir / "initial_model"
    if cfg.resume and (path / "config.json").is_file():
        return str(path), 0  # the same initial weights as before the kill
    save_pretrained(*load_policy(cfg.model), path)
    return str(path), 0


def start_step(cfg: Config) -> int:
    """Updates already in the starting model (trainer.total_steps counts updates): the run's
    newest checkpoint's when the job resumes, a `trainer.from_checkpoint` checkpoint's, else 0."""
    ckpt = None
    if cfg.resume:
        ckpt = newest_checkpoint(cfg.resolved_run_dir)
    if ckpt is None and cfg.trainer.from_checkpoint:
        ckpt = Path(cfg.trainer.from_checkpoint)
    if ckpt is None:
        return 0
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return int(state.get("steps", state["version"]))

