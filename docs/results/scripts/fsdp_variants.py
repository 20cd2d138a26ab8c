"""FSDP2 variants at two ranks against one rank, on bench trainer's workload (a scratch
experiment kept so that the numbers docs/trainer.md quotes from it can be re-made; not part of
the package). Each variant is a fresh set of processes; the list runs REPS times in order.

    PYTHONPATH=docs/results/scripts REPS=3 .venv/bin/python docs/results/scripts/fsdp_variants.py \
        4 one full grad_op grad_op_nosync root_nosync ddp

Variants: one (1 rank x 2 threads), ddp, full and grad_op (per-layer units, as ranks.py
shards before the gather-once change), full_prefetch (explicit forward / backward prefetch),
grad_op_nosync (gathered once per update: what trainer.sharding=grad_op does now), root and
root_nosync (one FSDP unit: the whole model). Prints tokens/s (median of the steps after a
warm-up), the optimizer step and clip times per step, and the load average.
"""
import contextlib, statistics, sys, time, os
import torch

def variant_shard(variant):
    from torch.distributed.fsdp import fully_shard
    def shard(model, ranks, sharding, frozen=False):
        units = set(getattr(model, "_no_split_modules", None) or ())
        if variant in ("full", "grad_op", "grad_op_nosync", "full_nosync", "full_prefetch"):
            keep = variant.startswith("grad_op") and not frozen
            layers = [m for m in model.modules() if type(m).__name__ in units]
            for m in layers:
                fully_shard(m, mesh=ranks.mesh, reshard_after_forward=not keep)
            fully_shard(model, mesh=ranks.mesh, reshard_after_forward=not keep)
            if variant == "full_prefetch":
                for a, b in zip(layers, layers[1:]):
                    a.set_modules_to_forward_prefetch([b])
                for a, b in zip(layers[1:], layers):
                    a.set_modules_to_backward_prefetch([b])
        elif variant.startswith("root"):  # one unit: the whole model
            fully_shard(model, mesh=ranks.mesh, reshard_after_forward=False)
        elif variant.startswith("two"):  # two halves of the layers + root
            layers = [m for m in model.modules() if type(m).__name__ in units]
            h = len(layers) // 2
            fully_shard(layers[:h], mesh=ranks.mesh, reshard_after_forward=False)
            fully_shard(layers[h:], mesh=ranks.mesh, reshard_after_forward=False)
            fully_shard(model, mesh=ranks.mesh, reshard_after_forward=False)
        return model
    return shard

def run(ranks, variant, steps):
    import laminar.trainer.trainer as tt
    from laminar.bench.trainer import workload
    from laminar.config import TrainerConfig
    from laminar.models import build_preset
    from laminar.models.tokenizer import PAD_ID
    from laminar.trainer.ranks import follow
    if ranks is not None and variant != "ddp":
        tt.shard = variant_shard(variant)
        if variant.endswith("nosync"):
            def gs(self, last):
                self.model.set_requires_gradient_sync(last)
                if hasattr(self.model, "set_reshard_after_backward"):
                    self.model.set_reshard_after_backward(last)
                return contextlib.nullcontext()
            tt.Trainer._gradient_sync = gs
    timers = {"opt": 0.0, "clip": 0.0}
    orig_clip = torch.nn.utils.clip_grad_norm_
    def clip(*a, **k):
        t = time.perf_counter(); r = orig_clip(*a, **k); timers["clip"] += time.perf_counter() - t; return r
    torch.nn.utils.clip_grad_norm_ = clip
    torch.manual_seed(0)
    trainer = tt.Trainer(build_preset("small", seed=0),
                         TrainerConfig(lr=1e-4, sharding="none" if variant == "ddp" else "full"),
                         pad_token_id=PAD_ID, ranks=ranks)
    ostep = trainer.optimizer.step
    def step(*a, **k):
        t = time.perf_counter(); r = ostep(*a, **k); timers["opt"] += time.perf_counter() - t; return r
    trainer.optimizer.step = step
    if ranks is not None and not ranks.is_leader:
        return follow(trainer, ranks)
    times, tokens, losses = [], [], []
    for seed in range(steps + 1):
        if seed == 1:
            timers.update(opt=0.0, clip=0.0)
        batch = workload(seed)
        t0 = time.perf_counter()
        st = trainer.train_step(batch)
        if seed:
            times.append(time.perf_counter() - t0); tokens.append(sum(t.num_tokens for t in batch))
        losses.append(st["loss"])
    return {"tps": statistics.median(n / s for n, s in zip(tokens, times)), "losses": losses,
            "opt_s_per_step": timers["opt"] / steps, "clip_s_per_step": timers["clip"] / steps,
            "step_s": statistics.median(times)}

if __name__ == "__main__":
    from laminar.trainer.ranks import spawn_ranks
    steps = int(sys.argv[1]); variants = sys.argv[2:]
    res = {}
    for rep in range(int(os.environ.get("REPS", "2"))):
        for v in variants:
            w = 1 if v == "one" else 2
            r = spawn_ranks(w, run, v, steps, threads=2 // w)
            res.setdefault(v, []).append(r)
            base = statistics.median(x["tps"] for x in res.get("one", [r]))
            print(f"{v:16s} tps {r['tps']:7.0f} ({r['tps']/base:.2f}x of one) step {r['step_s']:.3f}s opt {r['opt_s_per_step']*1e3:.0f}ms clip {r['clip_s_per_step']*1e3:.0f}ms load {os.getloadavg()[0]:.1f} loss0 {r['losses'][-1]:.6f}", flush=True)
