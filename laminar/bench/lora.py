"""`laminar bench lora`: what an adapter-only weight version saves against a full one.

    laminar bench lora [--quick] [--out docs/results/bench-lora.json]

The small preset (hidden 256, 4 layers), three variants built from the same seed:
  full           every parameter travels (trainer.lora unset) — the control
  lora_r8_attn   trainer.lora defaults: r=8 on q/k/v/o_proj
  lora_r16_all   r=16 on every linear layer of a decoder block (q/k/v/o, gate/up/down)
Adapters are given random values (B starts at zero; the timings do not depend on the values).

Per variant, interleaved round by round so the machine's noise hits all alike:
- push bytes: the tensor bytes of one version (what the relay tier stores and forwards);
- push stall: `Trainer.push` into a real relay process (laminar/bench/relay_node.py) through
  `Pusher`, as the trainer actor does — the time the trainer is blocked, median of the pushes;
- apply: what a rollout does with the version: pull it from its relay through shared memory,
  (LoRA) merge W0 + B @ A (laminar/engine/lora.py), and `Engine.load_weights` — median; the
  merge alone is reported too (`merge_s_by_variant`).
Ratios are LoRA / full in the same run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from laminar.bench.relay_node import RelayProcess
from laminar.config import LoraConfig, RelayConfig, TrainerConfig
from laminar.engine.engine import Engine
from laminar.engine.lora import LoraBase, _Merging, target_weight_names
from laminar.engine.protocol import RolloutEngine, WeightTarget
from laminar.models import build_preset
from laminar.models.tokenizer import EOS_ID, PAD_ID
from laminar.provenance import provenance, write_result
from laminar.relay.client import Puller, Pusher
from laminar.relay.plan import RelayInfo, build_chain
from laminar.trainer.actor import RelayPush
from laminar.trainer.trainer import Trainer

PRESET = "small"
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS: dict[str, dict[str, Any] | None] = {
    "full": None,
    "lora_r8_attn": {},  # the trainer.lora defaults
    "lora_r16_all": {"r": 16, "alpha": 32.0, "target_modules": ALL_LINEAR},
}


def _build(lora: dict[str, Any] | None) -> tuple[Any, Any, dict[str, Any]]:
    """(trainer, rollout engine, the base's weights) of one variant; the engine holds the base,
    as a rollout does."""
    import torch

    cfg = TrainerConfig(lora=None if lora is None else LoraConfig(**lora))
    trainer = Trainer(build_preset(PRESET, seed=0), cfg, PAD_ID)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.module.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    base = build_preset(PRESET, seed=0).eval()
    w0 = {k: v.detach().clone() for k, v in base.state_dict().items()}
    engine: RolloutEngine = Engine(base, EOS_ID, PAD_ID, max_batch_size=8)
    return trainer, engine, w0


def _rollout_target(engine: RolloutEngine, w0: dict[str, Any], lora: dict[str, Any] | None
                    ) -> WeightTarget:
    """What the rollout hands the puller: the engine, or the engine behind a W0 merge (`w0`:
    the base's weights, as a rollout reads them from its model directory)."""
    if lora is None:
        return engine
    class Timed(_Merging):
        """The rollout's merge, timing its W0 + B @ A part apart from the copy into the engine."""

        merge_s: list[float] = []

        def load_weights(self, named: Any, version: int) -> None:
            t0 = time.perf_counter()
            full = self.base.full_weights(named)
            self.merge_s.append(time.perf_counter() - t0)
            self.engine.load_weights(full, version)

    targets = LoraConfig(**lora).target_modules
    names = target_weight_names(w0, targets)
    target = Timed(engine, LoraBase({n: w0[n] for n in names}))
    target.merge_s = []
    return target


def main(quick: bool = False, out: str | None = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # the trainer's default share on a small machine; same for all
    rounds = 5 if quick else 20
    relay_cfg = RelayConfig()
    secret = uuid.uuid4().hex.encode()
    built = {name: _build(lora) for name, lora in VARIANTS.items()}
    targets = {name: _rollout_target(built[name][1], built[name][2], lora)
               for name, lora in VARIANTS.items()}
    stalls: dict[str, list[float]] = {name: [] for name in VARIANTS}
    applies: dict[str, list[float]] = {name: [] for name in VARIANTS}
    nbytes: dict[str, int] = {}
    print(f"bench lora: {PRESET} preset, {rounds} pushes and pulls per variant "
          f"({', '.join(VARIANTS)}), one relay process")
    with tempfile.TemporaryDirectory(prefix="laminar-bench-lora-") as tmp:
        relay = RelayProcess("r0", f"bl{uuid.uuid4().hex[:6]}", secret, relay_cfg,
                             log_path=Path(tmp) / "relay.log")
        try:
            sink = RelayPush(Pusher(build_chain([RelayInfo(**asdict(relay.info))]), secret, relay_cfg))
            puller = Puller(relay.info, relay_cfg)
            version = 0
            for k in range(rounds + 1):  # round 0 warms up every path
                for name in VARIANTS:
                    trainer = built[name][0]
                    version += 1
                    stall = trainer.push(sink, version, relay_cfg.chunk_bytes)
                    t0 = time.perf_counter()
                    got = puller.pull_latest(targets[name], newer_than=version - 1)
                    apply_s = time.perf_counter() - t0
                    assert got == version, (got, version)
                    if k:
                        stalls[name].append(stall)
                        applies[name].append(apply_s)
                    nbytes[name] = sum(t.numel() * t.element_size()
                                       for t in trainer.named_weights().values())
            sink.pusher.close()
            puller.close()
        finally:
            relay.close()
    merges = {n: t.merge_s[1:] for n, t in targets.items() if hasattr(t, "merge_s")}
    result = summarize(nbytes, stalls, applies, quick)
    result["merge_s_by_variant"] = {n: statistics.median(v) for n, v in merges.items()}
    result["provenance"] = provenance({"preset": PRESET, "rounds": rounds, "variants": VARIANTS,
                                       "chunk_bytes": relay_cfg.chunk_bytes, "threads": 1})
    _print(result)
    write_result(out, result)
    return result


def summarize(nbytes: dict[str, int], stalls: dict[str, list[float]],
              applies: dict[str, list[float]], quick: bool) -> dict[str, Any]:
    med = statistics.median
    stall = {n: med(v) for n, v in stalls.items()}
    apply = {n: med(v) for n, v in applies.items()}
    ratios = {}
    for name in nbytes:
        if name != "full":
            ratios[name] = {"push_bytes": nbytes[name] / nbytes["full"],
                            "push_stall": stall[name] / stall["full"],
                            "apply": apply[name] / apply["full"]}
    return {
        "quick": quick, "preset": PRESET,
        "push_bytes_by_variant": nbytes,
        "push_stall_s_by_variant": stall,
        "push_stall_s_range_by_variant": {n: [min(v), max(v)] for n, v in stalls.items()},
        "apply_s_by_variant": apply,
        "apply_s_range_by_variant": {n: [min(v), max(v)] for n, v in applies.items()},
        "ratios_vs_full": ratios,
    }


def _print(r: dict[str, Any]) -> None:
    print(f"\n{'variant':14s} {'push MB':>9s} {'stall ms (median, range)':>28s} "
          f"{'apply ms (median, range)':>28s}")
    for name, b in r["push_bytes_by_variant"].items():
        s, sr = r["push_stall_s_by_variant"][name], r["push_stall_s_range_by_variant"][name]
        a, ar = r["apply_s_by_variant"][name], r["apply_s_range_by_variant"][name]
        print(f"{name:14s} {b / 1e6:9.3f} {s * 1e3:10.2f} ({sr[0] * 1e3:6.2f}-{sr[1] * 1e3:6.2f}) "
              f"{a * 1e3:10.2f} ({ar[0] * 1e3:6.2f}-{ar[1] * 1e3:6.2f})")
    print("of which the merge W0 + B @ A: " + ", ".join(
        f"{n} {v * 1e3:.2f} ms" for n, v in r.get("merge_s_by_variant", {}).items()))
    for name, q in r["ratios_vs_full"].items():
        print(f"{name} / full: bytes {q['push_bytes']:.4f}x, stall {q['push_stall']:.3f}x, "
              f"apply {q['apply']:.3f}x")


if __name__ == "__main__":
    main()
