"""LoRA at the rollout: an adapter-only weight version turned into full weights.

A `trainer.lora` run pushes only adapter tensors (laminar/trainer/trainer.py, `adapter_weights`):

    <module>.lora_A   [r, in]
    <module>.lora_B   [out, r], already multiplied by alpha / r

where <module> is the dotted name of a linear layer in the base model's state_dict (e.g.
`model.layers.0.self_attn.q_proj`). A rollout keeps W0, the base weights of the target modules
only, and loads W = W0 + B @ A under the names `<module>.weight`; every other weight of the
engine is frozen in training and stays as the model directory had it.

Parts:
- `is_adapter_version(named)`: does a version hold adapter tensors (not full weights)?
- `merge(base, adapters)`: the pure step, W = W0 + B @ A, with an error for an adapter tensor
  naming no base module and for an A without its B;
- `base_dir(model_dir)`: the LoRA base of a starting model directory: a LoRA checkpoint's
  `model/` (the merged export) names its run's base in `../trainer_state.json` (`lora_base`);
  any other directory is its own base. Trainer and rollouts both ask it, so both hold the same W0;
- `LoraBase`: W0 read from a model directory, and `full_weights(named)`;
- `MergingWeights`: a rollout's weight source whose adapter-only versions load as full weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from laminar.config import ConfigError

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"


def is_adapter_version(names: Iterable[str]) -> bool:
    return any(n.endswith(A_SUFFIX) or n.endswith(B_SUFFIX) for n in names)


def adapter_modules(names: Iterable[str]) -> list[str]:
    """The module names of an adapter version, each with both its A and its B."""
    names = set(names)
    modules = sorted({n.removesuffix(A_SUFFIX).removesuffix(B_SUFFIX) for n in names})
    for m in modules:
        lacking = [s for s in (A_SUFFIX, B_SUFFIX) if m + s not in names]
        if lacking:
            raise ValueError(f"adapter version: module '{m}' has no '{m}{lacking[0]}' tensor; "
                             "every adapted module needs both lora_A and lora_B")
    others = sorted(n for n in names if not (n.endswith(A_SUFFIX) or n.endswith(B_SUFFIX)))
    if others:
        raise ValueError(f"adapter version mixes adapter and full tensors (e.g. '{others[0]}'): "
                         "a version holds one or the other")
    return modules


def merge(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]
          ) -> dict[str, torch.Tensor]:
    """W = W0 + B @ A for every module of `adapters`; `base` maps `<module>.weight` to W0
    ([out, in]). Returns `<module>.weight` -> W, new tensors in W0's dtype, on W0's device."""
    out = {}
    for m in adapter_modules(adapters):
        w0 = base.get(f"{m}.weight")
        if w0 is None:
            known = sorted(k.removesuffix(".weight") for k in base)
            raise KeyError(f"adapter tensor '{m}{A_SUFFIX}' names module '{m}', which has no base "
                           f"weight here (base modules: {known[:4]}{' ...' if len(known) > 4 else ''}, "
                           f"{len(known)} in all): the trainer's trainer.lora.target_modules and "
                           "the rollout's base differ")
        a, b = adapters[m + A_SUFFIX], adapters[m + B_SUFFIX]
        if b.shape[0] != w0.shape[0] or a.shape[1] != w0.shape[1] or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter of '{m}': lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} "
                             f"does not make the base weight's {tuple(w0.shape)}")
        # adapters come from host shared memory: on W0's device and dtype before the product
        b, a = b.to(device=w0.device, dtype=w0.dtype), a.to(device=w0.device, dtype=w0.dtype)
        out[f"{m}.weight"] = w0 + b @ a
    return out


def _recorded_base(model_dir: Path) -> str | None:
    """The `lora_base` a LoRA checkpoint's merged export (`.../model`) names, else None."""
    state = model_dir.parent / "trainer_state.json"
    if model_dir.name != "model" or not state.is_file():
        return None
    return json.loads(state.read_text()).get("lora_base")


def base_dir(model_dir: str | Path) -> Path:
    """The LoRA base of the starting model directory `model_dir` (see the module docstring)."""
    model_dir = Path(model_dir)
    base = _recorded_base(model_dir)
    if base is None:
        return model_dir
    if not (Path(base) / "config.json").is_file():
        raise ConfigError(
            f"the LoRA checkpoint {model_dir.parent} was trained on the base model "
            f"{base} (lora_base in its trainer_state.json), which is gone; put that "
            "model directory back at that path to resume it, or start a new run from "
            f"its merged weights with model.path={model_dir} without trainer.lora")
    return Path(base)


def is_lora_checkpoint_model(model_dir: str | Path) -> bool:
    """Is `model_dir` the merged export (`model/`) of a LoRA checkpoint?"""
    return _recorded_base(Path(model_dir)) is not None


def target_weight_names(names: Iterable[str], target_modules: list[str]) -> list[str]:
    """`<module>.weight` names whose module's last dotted part is a target (peft's rule)."""
    return [n for n in names if n.endswith(".weight")
            and n.removesuffix(".weight").rsplit(".", 1)[-1] in target_modules]


def read_weights(model_dir: str | Path, keep: Callable[[str], bool] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Tensors of a Hugging Face directory's safetensors files (one file or an indexed set),
    only those whose name `keep` accepts when given (the others are never read)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"LoRA base {model_dir} has no *.safetensors weights; laminar reads the "
                          "base of trainer.lora from a save_pretrained directory")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if keep is None or keep(key):
                    out[key] = st.get_tensor(key)
    return out


class LoraBase:
    """W0 of the target modules (the only copy a rollout keeps beside its engine)."""

    def __init__(self, weights: dict[str, torch.Tensor], path: str | None = None) -> None:
        self.weights = weights  # `<module>.weight` -> W0 [out, in]
        self.path = path

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, target_modules: list[str]) -> "LoraBase":
        """W0 of `model_dir`'s LoRA base (`base_dir`): the target modules' weights only."""
        path = base_dir(model_dir)
        weights = read_weights(path, lambda key: bool(target_weight_names([key], target_modules)))
        if not weights:
            raise ConfigError(f"trainer.lora.target_modules={target_modules} names no weight of the "
                              f"LoRA base {path}")
        return cls(weights, str(path))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def full_weights(self, named: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """An adapter version as full weights of its modules; a full version as it is."""
        return merge(self.weights, named) if is_adapter_version(named) else named


class _Merging:
    """A `load_weights` target that merges adapters before the engine copies the weights in."""

    def __init__(self, engine: Any, base: LoraBase) -> None:
        self.engine, self.base = engine, base

    def load_weights(self, named: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(self.base.full_weights(named), version)


class MergingWeights:
    """A rollout's weight source (rollout/io.py `WeightSource`) whose adapter-only versions are
    loaded as W0 + B @ A; every load path (the loop's pulls, the evaluator's) goes through it."""

    def __init__(self, inner: Any, base: LoraBase) -> None:
        self.inner, self.base = inner, base

    def newest(self) -> int | None:
        return self.inner.newest()

    def load_newest(self, engine: Any, newer_than: int) -> int | None:
        return self.inner.load_newest(_Merging(engine, self.base), newer_than=newer_than)


def rollout_lora(lora_cfg: Any, model_dir: str) -> LoraBase | None:
    """A rollout's W0 when `trainer.lora` is set (`lora_cfg`), else None. `model_dir`: the
    rollout's starting weights on this machine."""
    if lora_cfg is None:
        return None
    return LoraBase.from_model_dir(model_dir, list(lora_cfg.target_modules))
