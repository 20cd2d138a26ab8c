"""Checkpoints: model and optimizer as a torch distributed checkpoint, loadable at any world
size, beside a Hugging Face export of the weights.

    RUN_DIR/checkpoints/step_000010/
      model/               save_pretrained (weights + tokenizer): what rollouts and `laminar
                           resume` start from, and what evaluation or serving loads
      dcp/                 torch.distributed.checkpoint of {"model", "optim"}: each rank writes
                           its own shards, keyed by parameter name, so any number of ranks
                           (one, without a process group) loads it and reshards on the way in
      adapter/             trainer.lora only: peft's save_pretrained of the adapter (what
                           `PeftModel.from_pretrained(base, adapter/)` loads); model/ is then the
                           base with the adapter merged in, and dcp/ holds base and adapter
      rng.pt               rank 0's torch / numpy / Python RNG
      trainer_state.json   version, and the caller's state (update count, prompt position);
                           trainer.lora: `lora_base` (the run's base model directory, fixed for
                           its whole lineage) and `lora` (the adapter's settings)

`save` and `load` run on rank 0 and drive the other ranks (every rank takes part in the DCP
collectives and in gathering the full weights for the export). A checkpoint is written into
`step_N.tmp` and renamed: a crash never leaves half of one. Checkpoints written before DCP
(`optimizer.pt` instead of `dcp/`) still load, at world size 1.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from laminar.config import ConfigError


def save(trainer: Any, path: Path, tokenizer: PreTrainedTokenizerBase, extra: dict[str, Any]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _on_every_rank(trainer, _write_shards, str(tmp))
    tokenizer.save_pretrained(tmp / "model")
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                "python": random.getstate()}, tmp / "rng.pt")
    lora = trainer.cfg.lora
    if lora is not None:
        extra = {**extra, "lora_base": trainer.lora_base, "lora": lora.model_dump()}
    (tmp / "trainer_state.json").write_text(json.dumps({"version": trainer.version, **extra}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def load(trainer: Any, path: Path) -> dict[str, Any]:
    """Restore weights, optimizer, version and RNG; returns the caller state saved with it.
    The optimizer's hyperparameters are the config's (a resume may lower trainer.lr)."""
    extra = json.loads((path / "trainer_state.json").read_text())
    _check_lora(trainer, path, extra)
    if (path / "dcp").is_dir():
        _on_every_rank(trainer, _read_shards, str(path))
    elif trainer.ranks is None:
        _read_single_process(trainer, path)
    else:
        raise ConfigError(f"checkpoint {path} predates sharded checkpoints (optimizer.pt, no "
                          "dcp/): resume it once with trainer.world_size=1, whose next checkpoint "
                          "loads at any world size")
    cfg = trainer.cfg
    for group in trainer.optimizer.param_groups:
        group.update(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    trainer.version = extra.pop("version")
    if "lora_base" in extra:
        trainer.lora_base = extra.pop("lora_base")
        extra.pop("lora")
    return extra


def _check_lora(trainer: Any, path: Path, state: dict[str, Any]) -> None:
    """A LoRA checkpoint loads only into a trainer with the same trainer.lora, and a full one
    only into a trainer without it."""
    lora, saved = trainer.cfg.lora, state.get("lora")
    if lora is not None and saved is None:
        raise ConfigError(f"checkpoint {path} holds full weights (its run had no trainer.lora), "
                          "so a trainer.lora trainer cannot load it; to train adapters on its "
                          f"weights start a new run with model.path={path / 'model'} (no "
                          "trainer.from_checkpoint), or drop trainer.lora to resume it as it was")
    if lora is None and saved is not None:
        raise ConfigError(f"checkpoint {path} holds LoRA adapters (trainer.lora={saved}); resume "
                          "it with the same trainer.lora, or fine-tune its merged weights in a "
                          f"new run with model.path={path / 'model'} copied out of the checkpoint")
    if lora is not None and {**saved, "dropout": 0} != {**lora.model_dump(), "dropout": 0}:
        raise ConfigError(f"checkpoint {path} was trained with trainer.lora={saved}, this trainer "
                          f"has trainer.lora={lora.model_dump()}: r, alpha and target_modules "
                          "must match to continue its adapters; set them as the checkpoint has")


def export_pretrained(trainer: Any, out: str) -> None:
    """Every rank: gather the full weights, and rank 0 writes them with `save_pretrained` into
    `out` (no tokenizer). trainer.lora: the merged weights, and the adapter beside (`adapter/`);
    rank 0 holds all of them (DDP), so the other ranks write nothing."""
    if trainer.cfg.lora is not None:
        if trainer.ranks is None or trainer.ranks.is_leader:
            trainer.module.save_pretrained(out, state_dict=trainer.merged_state_dict())
            trainer.peft_model.peft_config["default"].base_model_name_or_path = trainer.lora_base
            with warnings.catch_warnings():  # peft looks up the base model's name online
                warnings.simplefilter("ignore")
                trainer.peft_model.save_pretrained(str(Path(out).parent / "adapter"))
        return
    if trainer.ranks is None:
        trainer.module.save_pretrained(out)
        return
    full = full_state_dict(trainer)
    if trainer.ranks.is_leader:
        trainer.module.save_pretrained(out, state_dict=full)


def full_state_dict(trainer: Any) -> dict[str, torch.Tensor]:
    """Every rank: the model's whole state dict gathered on rank 0, in CPU memory (one
    collective per tensor); the other ranks get an empty dict."""
    if trainer.ranks is None:
        return {k: v.detach() for k, v in trainer.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))


def _on_every_rank(trainer: Any, fn: Any, *args: Any) -> None:
    if trainer.ranks is None:
        fn(trainer, *args)
    else:
        trainer.ranks.call_all(trainer, fn, *args)


def _write_shards(trainer: Any, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(trainer.model, trainer.optimizer)
    with warnings.catch_warnings():  # one process without a process group is what we mean
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save({"model": model, "optim": optim}, checkpoint_id=Path(tmp) / "dcp")
    export_pretrained(trainer, str(Path(tmp) / "model"))


def _read_shards(trainer: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = get_state_dict(trainer.model, trainer.optimizer)  # the shapes to fill
    state = {"model": model, "optim": optim}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=Path(path) / "dcp")
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _read_single_process(trainer: Any, path: Path) -> None:
    """A checkpoint from before DCP: Hugging Face weights and a plain optimizer state dict."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)
    trainer.module.load_state_dict(saved.state_dict())
    trainer.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
