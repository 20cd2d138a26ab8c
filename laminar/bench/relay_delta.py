"""`laminar bench relay --delta`: delta versions against whole ones, as ratios in one run.

    laminar bench relay --delta [--quick] [--out bench-relay-delta.json]

1. **Bytes** (no network). Versions in bf16 (and fp32) before and after an update, encoded
   chunk by chunk (1 MiB) as the master does (`relay/delta.py`), at lr 1e-6, 1e-5, 1e-4:
   - the `small` preset with real AdamW steps (the LM loss of random tokens);
   - a synthetic model of 256 MiB in bf16 (64 MiB with --quick): fp32 master weights ~N(0, 0.02)
     moved by Adam-like steps, lr * N(0, 1) clamped to +-3 per element (an Adam step's
     m / sqrt(v) is about +-1; this is at the large end of it).
   Reported: delta bytes / full bytes, the fraction of 16-bit words that changed, the other
   candidate encoding (XOR of the raw bytes + zlib level 1) for comparison, and whether every
   decoded chunk was bit for bit the new one (`delta_exact`).
2. **Chain** (the synthetic model, lr 1e-6): 4 relay processes, one per emulated node, on
   namespaced 1 Gbit/s links (laminar/devcluster/netns.py, as `laminar bench relay`; a token
   bucket in the transport where namespaces are unavailable). Versions whole (relay.full_every
   = 1) and as deltas, each variant on its own 4 nodes, both running, their rounds alternating:
   the chain time (from the master holding the version to the last relay holding it complete,
   relays' own clocks) and the trainer's push stall, medians.
3. **Late joiner** (delta variant): a fifth relay joins the tail while the next version is
   pushed; its catch-up (join to holding that version) against one whole version's transfer
   over one link (the whole variant's first hop).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laminar.bench.links import Netns
from laminar.bench.relay_node import RelayProcess
from laminar.config import RelayConfig
from laminar.relay.client import Pusher
from laminar.relay.delta import decode_chunk, encode_chunk, xor_zlib_size
from laminar.relay.plan import build_chain, join

MiB = 1 << 20
LRS = (1e-6, 1e-5, 1e-4)
SECRET = uuid.uuid4().hex.encode()
RATE_MBIT = 1000.0
CHAIN = 4


class SyntheticModel:
    """fp32 masters of `nbytes` in bf16, 8 tensors, moved by Adam-like steps."""

    def __init__(self, nbytes: int, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        n = nbytes // 2 // 8
        self.masters = [torch.randn(n // 1024, 1024, generator=self.g) * 0.02 for _ in range(8)]

    def step(self, lr: float) -> None:
        for t in self.masters:
            for rows in t.split(1024):  # in slices: no second full-size temporary
                rows -= lr * torch.randn(rows.shape, generator=self.g).clamp_(-3, 3)

    def published(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        return {f"layers.{i}.weight": t.to(dtype) for i, t in enumerate(self.masters)}


def _flat(named: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in named.values()])


def measure_bytes(base: np.ndarray, new: np.ndarray, xor: bool = True) -> dict[str, Any]:
    """Delta / full bytes of the relay's encoding (and of XOR + zlib), the changed fraction,
    encode seconds, and whether every chunk decoded bit for bit."""
    size, xsize, exact, enc_s = 0, 0, True, 0.0
    out = np.empty(MiB, dtype=np.uint8)
    for a in range(0, new.size, MiB):
        n, b = new[a:a + MiB], base[a:a + MiB]
        t0 = time.perf_counter()
        payload = encode_chunk(n.data, b.data)
        enc_s += time.perf_counter() - t0
        size += len(payload)
        decode_chunk(payload, b.data, out[:n.size].data)
        exact &= bool(np.array_equal(out[:n.size], n))
        if xor:
            xsize += xor_zlib_size(n.data, b.data)
    changed = float(np.mean(base.view(np.uint16) != new.view(np.uint16)))
    return {"ratio": size / new.size, "xor_zlib_ratio": xsize / new.size if xor else None,
            "changed_fraction": changed, "encode_mb_per_s": new.size / enc_s / 1e6, "exact": exact}


def bytes_part(big: int) -> dict[str, Any]:
    from laminar.models import build_preset  # torch + transformers: this part only

    res: dict[str, Any] = {}
    for lr in LRS:
        model = build_preset("small", seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
        ids = torch.randint(4, 100, (8, 64), generator=torch.Generator().manual_seed(0))
        rows = {"bf16": [], "fp32": []}
        for _ in range(2):
            before = {d: _flat({k: p.detach().to(dt) for k, p in model.named_parameters()})
                      for d, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            for d, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                after = _flat({k: p.detach().to(dt) for k, p in model.named_parameters()})
                rows[d].append(measure_bytes(before[d], after, xor=d == "bf16"))
        res.setdefault("small", {})[str(lr)] = {d: _mean(r) for d, r in rows.items()}
        print(f"  small preset lr {lr:g}: bf16 {res['small'][str(lr)]['bf16']['ratio']:.4f} "
              f"(changed {res['small'][str(lr)]['bf16']['changed_fraction']:.4f}), fp32 "
              f"{res['small'][str(lr)]['fp32']['ratio']:.4f}", flush=True)
    label = f"synthetic_{big // MiB}MiB"
    for lr in LRS:
        model = SyntheticModel(big)
        before = _flat(model.published())
        model.step(lr)
        r = measure_bytes(before, _flat(model.published()), xor=lr != 1e-4 or big <= 64 * MiB)
        res.setdefault(label, {})[str(lr)] = {"bf16": r}
        print(f"  {label} lr {lr:g}: bf16 {r['ratio']:.4f} (changed {r['changed_fraction']:.4f}, "
              f"xor+zlib {r['xor_zlib_ratio']}), encode {r['encode_mb_per_s']:.0f} MB/s", flush=True)
        del model, before
    return res


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        out[k] = all(vals) if isinstance(vals[0], bool) else (
            None if vals[0] is None else statistics.mean(vals))
    return out


class _Variant:
    """CHAIN relays (+ one that joins later) of one config, on the emulated links."""

    def __init__(self, stack: ExitStack, net: Netns | None, cfg: RelayConfig, tmp: Path, tag: str,
                 nodes: list[int]) -> None:
        job = f"bd{tag}{uuid.uuid4().hex[:5]}"
        self.relays = [stack.enter_context(RelayProcess(
            f"n{i}", job, SECRET, cfg.model_copy(update={"host": net.address(i) if net else "127.0.0.1"}),
            prefix=net.prefix(i) if net else None, log_path=tmp / f"{tag}-n{i}.log",
            rate_mbit=0.0 if net else RATE_MBIT)) for i in nodes]
        self.plan = build_chain([r.info for r in self.relays[:CHAIN]], epoch=1)
        self.pusher = Pusher(self.plan, SECRET, cfg)
        stack.callback(self.pusher.close)
        self._set_plan()
        self.version = 0

    def _set_plan(self) -> None:
        for r in self.relays:  # the one not in the plan yet idles
            r.call("set_plan", plan=self.plan.to_dict())
        self.pusher.set_plan(self.plan)

    def push(self, model: SyntheticModel) -> tuple[int, float]:
        self.version += 1
        return self.version, self.pusher.push(model.published(), self.version).seconds

    def wait(self, relays: list[RelayProcess], version: int, timeout: float = 600.0) -> list[dict]:
        end = time.time() + timeout
        for r in reversed(relays):
            while (r.heartbeat()["latest"] or -1) < version:
                if time.time() > end:
                    raise TimeoutError(f"relay {r.id} did not reach version {version} in {timeout}s")
                time.sleep(0.05)
        return [r.heartbeat() for r in relays]

    def round(self, model: SyntheticModel, lr: float) -> dict[str, float]:
        model.step(lr)
        v, stall = self.push(model)
        beats = self.wait(self.relays[:CHAIN], v)
        done = [b["completed_at"][str(v)] for b in beats]
        wire = [b["arrivals"][str(v)]["wire_bytes"] for b in beats[1:]]
        return {"chain_s": max(done) - done[0], "first_hop_s": done[1] - done[0], "stall_s": stall,
                "wire_over_full": statistics.mean(wire) / beats[1]["arrivals"][str(v)]["bytes"]}

    def late_join(self, model: SyntheticModel, lr: float) -> dict[str, Any]:
        """The fifth relay joins the tail and the next version (made beforehand: the trainer's
        step is not the joiner's catch-up) is pushed at once."""
        late = self.relays[CHAIN]
        self.plan = join(self.plan, late.info)
        model.step(lr)
        named = model.published()
        t0 = time.time()
        self._set_plan()
        t_plan = time.time()
        self.version += 1
        v = self.version
        self.pusher.push(named, v)
        t_push = time.time()
        [beat] = self.wait([late], v)
        prev = beat["arrivals"].get(str(v - 1), {})
        return {"catch_up_s": beat["completed_at"][str(v)] - t0, "version": v,
                "set_plan_s": t_plan - t0, "push_s": t_push - t_plan,
                "whole_version_s": prev.get("seconds"),
                "whole_version_wire_bytes": prev.get("wire_bytes"),
                "next_version_wire_bytes": beat["arrivals"][str(v)]["wire_bytes"],
                "refused": self.relays[CHAIN - 1].heartbeat()["delta"].get("delta_refused", 0)}


def chain_part(nbytes: int, reps: int, tmp: Path) -> dict[str, Any]:
    ok, why = Netns.available()
    res: dict[str, Any] = {"network": "netns+veth+tbf" if ok else "in-transport token bucket",
                           "network_note": why, "rate_mbit": RATE_MBIT, "relays": CHAIN}
    rounds: dict[str, list[dict[str, float]]] = {"full": [], "delta": []}
    with ExitStack() as stack:
        # both variants at once, on their own nodes (the delta one has a fifth that joins
        # later), their rounds alternating: a change in the machine's load hits both alike
        net = stack.enter_context(Netns(2 * CHAIN + 1, RATE_MBIT)) if ok else None
        variants, models = {}, {}
        for name, full_every, nodes in (("full", 1, range(CHAIN)),
                                        ("delta", 1 << 30, range(CHAIN, 2 * CHAIN + 1))):
            cfg = RelayConfig(timeout_s=30.0, heartbeat_s=1.0, full_every=full_every)
            variants[name] = _Variant(stack, net, cfg, tmp, name, list(nodes))
            models[name] = SyntheticModel(nbytes)
        for _ in range(RelayConfig().keep_versions + 1):  # slots allocated at this size; a base
            for name, var in variants.items():
                var.round(models[name], 1e-6)
        for rep in range(reps):
            for name, var in variants.items():
                rounds[name].append(var.round(models[name], 1e-6))
                r = rounds[name][-1]
                print(f"  {name} rep {rep}: chain {r['chain_s']:.3f}s, first hop "
                      f"{r['first_hop_s']:.3f}s, push stall {r['stall_s']:.3f}s, wire/full "
                      f"{r['wire_over_full']:.4f}", flush=True)
        late = variants["delta"].late_join(models["delta"], 1e-6)
        print(f"  late joiner: caught up in {late['catch_up_s']:.3f}s", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    res.update({"median": med, "samples": rounds, "late_join": late,
                "delta_chain_time_ratio": med["delta"]["chain_s"] / med["full"]["chain_s"],
                "delta_push_stall_ratio": med["delta"]["stall_s"] / med["full"]["stall_s"],
                "late_join_ratio": late["catch_up_s"] / med["full"]["first_hop_s"]})
    return res


def main(quick: bool = False, out: str | None = None) -> dict[str, Any]:
    import json

    from laminar.provenance import provenance

    big = (64 if quick else 256) * MiB
    reps = 2 if quick else 5
    print(f"relay delta bench: bytes by lr (small preset, {big // MiB} MiB synthetic), then a chain "
          f"of {CHAIN} relays at {RATE_MBIT:g} Mbit/s, whole vs delta", flush=True)
    res: dict[str, Any] = {"synthetic_mib": big // MiB, "chunk_bytes": MiB, "reps": reps}
    res["bytes"] = bytes_part(big)
    key = f"synthetic_{big // MiB}MiB"
    res["delta_bytes_ratio_by_lr"] = {lr: v["bf16"]["ratio"] for lr, v in res["bytes"][key].items()}
    res["changed_fraction_by_lr"] = {lr: v["bf16"]["changed_fraction"] for lr, v in res["bytes"][key].items()}
    res["small_preset_delta_bytes_ratio_by_lr"] = {lr: v["bf16"]["ratio"]
                                                   for lr, v in res["bytes"]["small"].items()}
    res["delta_exact"] = all(d["exact"] for part in res["bytes"].values()
                             for by_dtype in part.values() for d in by_dtype.values())
    with tempfile.TemporaryDirectory(prefix="lam-bench-delta-") as tmp:
        res["chain"] = chain_part(big, reps, Path(tmp))
    for k in ("delta_chain_time_ratio", "delta_push_stall_ratio", "late_join_ratio"):
        res[k] = res["chain"][k]
    res["load_average"] = os.getloadavg()
    res["provenance"] = provenance({"quick": quick, "synthetic_mib": big // MiB, "reps": reps,
                                    "rate_mbit": RATE_MBIT, "relays": CHAIN})
    print(f"delta_bytes_ratio_by_lr {res['delta_bytes_ratio_by_lr']} (target <= 0.1 at 1e-6)")
    print(f"changed_fraction_by_lr {res['changed_fraction_by_lr']}")
    print(f"delta_chain_time_ratio {res['delta_chain_time_ratio']:.3f} (<= 0.3), "
          f"delta_push_stall_ratio {res['delta_push_stall_ratio']:.3f} (<= 1), late_join_ratio "
          f"{res['late_join_ratio']:.3f} (<= 1.5), delta_exact {res['delta_exact']}")
    if out:
        Path(out).write_text(json.dumps(res, indent=2))
        print(f"wrote {out}")
    return res
