"""The sharded trainer as real processes: two ranks in one gloo process group on this machine.

Every two-rank run is `spawn_ranks` (fresh processes, a real TCPStore rendezvous, FSDP2 or
DDP); the single-rank reference runs in the test process on the same batch and weights.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
import torch

from laminar.config import RelayConfig, TrainerConfig
from laminar.models import build_preset
from laminar.trainer.batching import split_groups
from laminar.trainer.checkpoint import full_state_dict
from laminar.trainer.ranks import (fit_problem, follow, plan_micro_batches, rank_bundles,
                                   spawn_ranks, split_by_tokens)
from laminar.trainer.trainer import Trainer
from laminar.types import Trajectory

# Tolerance. Two ranks sum the same per-token terms in another order, so gradients differ in
# the last float bits (loss and gradient norm: compared to 1e-5 relative). AdamW's step is
# lr * m / sqrt(v): scale-free, so such differences stay ~1e-7 of lr, except where a gradient
# is itself a cancellation near 0. Measured: at most 5.4e-7 after 3 global batches (6 updates)
# with full, grad_op and none; the parameters are compared to lr / 100 absolute.
LR = 1e-3
PARAM_ATOL = LR / 100


def batch(seed: int, groups: int = 6, size: int = 4) -> list[Trajectory]:
    """Long-tailed prompt and response lengths, so ranks get different micro-batch counts."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for i in range(size):
            prompt = [1] + [rng.randrange(3, 100) for _ in range(rng.choice([2, 3, 5, 20]))]
            response = [rng.randrange(3, 100) for _ in range(rng.choice([1, 4, 9, 40]))] + [2]
            out.append(Trajectory(traj_id=f"g{seed}.{g}/{i}", group_id=f"g{seed}.{g}",
                                  prompt_ids=prompt, response_ids=response,
                                  logprobs=[-rng.random() * 3 for _ in response], version=0,
                                  reward=rng.random()))
    return out


# FSDP runs with the frozen copies too (a KL reference and the proximal weights of decoupled
# PPO, sharded like the model), grad_op (gathered once per update, gradients accumulated
# unsharded) with the KL reference; DDP with the plain loss
LOSSES = {"full": {"kl_coef": 0.05, "correction": "decoupled"}, "grad_op": {"kl_coef": 0.05},
          "none": {}}


def config(sharding: str = "full", **kw) -> TrainerConfig:
    return TrainerConfig(**{"lr": LR, "mini_batches": 2, "micro_batch_tokens": 200,
                            "grad_clip": 0.02,  # the clip acts: norms are ~0.05
                            "sharding": sharding, **LOSSES[sharding], **kw})


def single(cfg: TrainerConfig) -> Trainer:
    torch.manual_seed(0)
    return Trainer(build_preset("tiny", seed=0), cfg, pad_token_id=0)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.module.named_parameters()}


def _gathered(trainer: Trainer) -> dict[str, torch.Tensor]:
    return full_state_dict(trainer)


def _session(ranks, cfg: TrainerConfig, relay: dict, secret: bytes, relay_cfg: RelayConfig,
             ckpt: str):
    """Every rank: train batch 0; push the weights from the shards (version 1) and by gathering
    (version 2), reading each back from the relay's shared memory; checkpoint; train batch 1.
    Rank 0 returns the stats, the pulled versions and the gathered parameters of each step."""
    torch.manual_seed(0)
    trainer = Trainer(build_preset("tiny", seed=0), cfg, pad_token_id=0, ranks=ranks)
    if not ranks.is_leader:
        return follow(trainer, ranks)
    from laminar.relay.client import Puller, Pusher
    from laminar.relay.plan import RelayInfo, build_chain
    from laminar.trainer.actor import RelayPush
    from laminar.trainer.shards import push_from_shards

    out = {"stats": [trainer.train_step(batch(0))], "full": [ranks.call_all(trainer, _gathered)[0]]}
    info = RelayInfo(**relay)
    pusher, puller = Pusher(build_chain([info]), secret, relay_cfg), Puller(info, relay_cfg)
    out["pulled"] = {}
    for version, method in ((1, None), (2, "gather")):
        push_from_shards(trainer, RelayPush(pusher), version, relay_cfg.chunk_bytes, method)
        with puller.open_latest() as v:
            assert v.version == version and v.snapshot.verify() == []  # every chunk's crc32
            out["pulled"][method] = {k: t.clone() for k, t in v.named_tensors().items()}
    pusher.close()
    puller.close()
    trainer.save_checkpoint(ckpt, _tokenizer())
    out["stats"].append(trainer.train_step(batch(1)))
    out["full"].append(ranks.call_all(trainer, _gathered)[0])
    out["version"] = trainer.version
    return out


def _resumed(ranks, cfg: TrainerConfig, ckpt: str):
    """Every rank: load the checkpoint, train batch 1; rank 0 returns stats and parameters."""
    torch.manual_seed(0)
    trainer = Trainer(build_preset("tiny", seed=0), cfg, pad_token_id=0, ranks=ranks)
    if not ranks.is_leader:
        return follow(trainer, ranks)
    trainer.load_checkpoint(ckpt)
    stats = trainer.train_step(batch(1))
    return stats, ranks.call_all(trainer, _gathered)[0], trainer.version


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """`two_ranks(sharding)`: one two-rank `_session` per sharding (starting processes is
    most of the cost), with a real relay process as the master."""
    from dataclasses import asdict

    from laminar.bench.relay_node import RelayProcess

    done = {}

    def run(sharding: str) -> dict:
        if sharding not in done:
            tmp = tmp_path_factory.mktemp(sharding)
            relay_cfg = RelayConfig(chunk_bytes=64 << 10)  # many chunks: rows cross their borders
            secret = uuid.uuid4().hex.encode()
            relay = RelayProcess("r0", f"t{uuid.uuid4().hex[:8]}", secret, relay_cfg,
                                 log_path=tmp / "relay.log")
            try:
                done[sharding] = spawn_ranks(2, _session, config(sharding),
                                             asdict(relay.info), secret, relay_cfg,
                                             str(tmp / "step_000001"))
            finally:
                relay.close()
            done[sharding]["ckpt"] = tmp / "step_000001"
        return done[sharding]

    return run


def _tokenizer():
    from laminar.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


# ------------------------------------------------------------------------------- the update


# grad_op in the slow set (the default suite's budget): it shares full's code path but for
# when parameters are re-sharded, which test_the_pushed_version_is_the_gathered_state_dict
# still runs by default
@pytest.mark.parametrize("sharding", ["full", pytest.param("grad_op", marks=pytest.mark.slow), "none"])
def test_two_ranks_make_the_single_rank_update(sharding, two_ranks):
    """Two optimizer updates (mini_batches=2) on a long-tailed batch: the ranks hold different
    numbers of micro-batches (the short side runs empty ones), yet the loss, the clipped
    gradient norm and every parameter after the updates match one rank's."""
    cfg = config(sharding)
    ref = single(cfg)
    want = ref.train_step(batch(0))
    run = two_ranks(sharding)
    got, full = run["stats"][0], run["full"][0]
    for key in ("loss", "grad_norm", "clip_frac", "ratio_mean", "kl", *(
            ["correction_weight_mean"] if cfg.correction.kind == "decoupled" else [])):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    # the engine-trainer mismatch: every rank's tokens gathered (p99 needs them all, not a sum)
    for key in ("logprob_abs_diff_mean", "logprob_abs_diff_p99"):
        assert want[key] > 0.1 and got[key] == pytest.approx(want[key], rel=1e-5), key
    assert want["grad_norm"] > cfg.grad_clip  # the clip is active
    assert (want["kl"] > 0) == (cfg.kl_coef > 0)  # the reference model took part
    for name, p in params(ref).items():
        torch.testing.assert_close(full[name], p, rtol=0, atol=PARAM_ATOL, msg=name)
    plans = [plan_micro_batches([t.num_tokens for t in mb], 2, cfg.micro_batch_tokens)
             for mb in split_groups(batch(0), cfg.mini_batches)]
    assert any(len(p[0]) != len(p[1]) for p in plans)  # so one rank ran an empty micro-batch
    assert all(len(p[0]) > 1 for p in plans)  # and every update accumulated micro-batches


def test_the_token_split_balances_tokens_not_counts():
    lengths = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    shares = split_by_tokens(lengths, 2)
    assert shares == [[0], list(range(1, 11))]  # one long sequence weighs as much as ten short
    assert split_by_tokens([5, 5, 5], 1) == [[0, 1, 2]]
    assert split_by_tokens([7], 3) == [[0], [], []]  # a rank may get nothing: it runs empty steps
    from laminar.trainer.batching import token_budget_batches

    lengths = [t.num_tokens for t in batch(3)]
    assert plan_micro_batches(lengths, 1, 160) == [token_budget_batches(lengths, 160)]
    two = plan_micro_batches(lengths, 2, 160)
    assert sorted(i for rank in two for g in rank for i in g) == list(range(len(lengths)))
    loads = [sum(lengths[i] for g in rank for i in g) for rank in two]
    assert abs(loads[0] - loads[1]) <= max(lengths)


def test_placement_says_why_ranks_do_not_fit():
    bundles = rank_bundles(3, 2, {"GPU": 1}, head_ip="10.0.0.1")
    assert bundles[0] == {"CPU": 2.0, "GPU": 1.0, "node:10.0.0.1": 0.001}
    assert bundles[1] == {"CPU": 2.0, "GPU": 1.0}
    nodes = {"10.0.0.1": {"CPU": 8, "GPU": 1, "node:10.0.0.1": 1},
             "10.0.0.2": {"CPU": 8, "GPU": 2, "node:10.0.0.2": 1}}
    assert fit_problem(bundles, nodes) is None
    problem = fit_problem(rank_bundles(4, 2, {"GPU": 1}, "10.0.0.1"), nodes)
    assert "4 trainer ranks of {CPU: 2, GPU: 1} each do not fit: only 3 can be placed" in problem
    assert "10.0.0.2: CPU 8, GPU 2" in problem
    problem = fit_problem(rank_bundles(1, 2, {"GPU": 1}, "10.0.0.3"), nodes)
    assert "only 0 can be placed (rank 0 on the driver's node)" in problem
    assert fit_problem(rank_bundles(2, 1, {}), {"local": {"CPU": 2}}) is None
    assert "only 1" in fit_problem(rank_bundles(2, 2, {}), {"local": {"CPU": 2}})


# ------------------------------------------------------------------------------ checkpoints


def test_a_two_rank_checkpoint_resumes_at_one_and_at_two_ranks(two_ranks):
    """Train at two ranks, checkpoint (DCP + HF export), train on: resuming the checkpoint at
    one rank and at two and training the same next batch ends with the same parameters (the
    optimizer's moments came back too: without them AdamW's step would differ by ~lr)."""
    cfg = config()
    run = two_ranks("full")
    ckpt, first, full = run["ckpt"], run["stats"][1], run["full"][1]
    assert run["version"] == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["dcp", "model", "rng.pt", "trainer_state.json"]
    from laminar.pools.resume import checkpoint_problem

    assert checkpoint_problem(ckpt) is None
    one = single(cfg)
    assert one.load_checkpoint(ckpt) == {} and one.version == 1
    # the Hugging Face export is the gathered weights of the checkpoint
    from transformers import AutoModelForCausalLM

    exported = dict(AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
                    .named_parameters())
    assert list(exported) == list(params(one))
    for name, p in exported.items():
        assert torch.equal(run["full"][0][name], p) and torch.equal(params(one)[name], p), name
    again = one.train_step(batch(1))
    assert again["loss"] == pytest.approx(first["loss"], rel=1e-5)
    for name, p in params(one).items():
        torch.testing.assert_close(full[name], p, rtol=0, atol=PARAM_ATOL, msg=name)
    two, full2, version2 = spawn_ranks(2, _resumed, cfg, str(ckpt))
    assert version2 == 2 and two["loss"] == pytest.approx(first["loss"], rel=1e-5)
    for name, p in full.items():
        torch.testing.assert_close(full2[name], p, rtol=0, atol=PARAM_ATOL, msg=name)
    without = single(cfg)  # the control: the same weights, fresh optimizer moments
    without.module.load_state_dict(run["full"][0])
    without.train_step(batch(1))
    assert max((full[n] - p).abs().max().item() for n, p in params(without).items()) > PARAM_ATOL


def test_a_resume_takes_the_learning_rate_of_its_config(tmp_path):
    trainer = single(config())
    trainer.train_step(batch(0))
    trainer.save_checkpoint(tmp_path / "c", _tokenizer())
    lower = single(config(lr=LR / 10))
    lower.load_checkpoint(tmp_path / "c")
    assert {g["lr"] for g in lower.optimizer.param_groups} == {LR / 10}
    assert lower.optimizer.state  # the moments came back


# ------------------------------------------------------------------------------ weight push


@pytest.mark.parametrize("sharding", ["full", "grad_op", "none"])
def test_the_pushed_version_is_the_gathered_state_dict(sharding, two_ranks):
    """Each rank writes its rows straight into the master relay's slot (and, as the other
    way, rank 0 gathers them): the version the relay publishes, every chunk's checksum
    verified, is the full state dict bit for bit, under the single-rank push's names."""
    run = two_ranks(sharding)
    names = list(dict(build_preset("tiny").named_parameters()))
    for method in (None, "gather"):
        assert list(run["pulled"][method]) == names
        for name in names:
            assert torch.equal(run["pulled"][method][name], run["full"][0][name]), (method, name)
