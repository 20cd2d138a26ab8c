"""LoRA (`trainer.lora`): the trainer trains peft adapters on a frozen base and a weight
version holds only the adapters; a rollout merges them into its copy of the base (W0 + B @ A).
Everything here is real: the trainer, a relay process, Ray rollouts on the tiny preset."""

from __future__ import annotations

import copy
import json
import uuid

import pytest
import torch

from laminar.config import ConfigError, RelayConfig, load_config
from laminar.engine.lora import LoraBase, base_dir, merge
from laminar.models import build_preset, load_pretrained, save_pretrained
from laminar.models.tokenizer import PAD_ID, build_char_tokenizer
from laminar.trainer.trainer import Trainer

LORA = ["trainer.lora={}"]


def _lora_trainer(*overrides: str, model=None) -> Trainer:
    cfg = load_config(None, [*LORA, *overrides]).trainer
    return Trainer(model if model is not None else build_preset("tiny", seed=0), cfg, PAD_ID)


def _random_adapters(trainer: Trainer, seed: int = 0) -> None:
    """B starts at zero (the adapter is a no-op); give A and B values as training would."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.module.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _base_dir(tmp_path):
    d = tmp_path / "base"
    save_pretrained(build_preset("tiny", seed=0), build_char_tokenizer(), d)
    return d


def test_merge_equals_peft_merge_and_unload():
    """laminar's merge of the pushed tensors (B pre-scaled by alpha/r) gives peft's own merged
    weights; tolerance 1e-6 absolute (fp32; the two differ only in where alpha/r multiplies)."""
    trainer = _lora_trainer("trainer.lora.r=4", "trainer.lora.alpha=12")
    _random_adapters(trainer)
    base = {k: v for k, v in build_preset("tiny", seed=0).state_dict().items()}
    pushed = trainer.adapter_weights()
    merged = merge(base, pushed)
    reference = copy.deepcopy(trainer.peft_model).merge_and_unload().state_dict()
    assert set(merged) == {f"model.layers.{i}.self_attn.{p}_proj.weight"
                           for i in range(2) for p in "qkvo"}
    for name, w in merged.items():
        assert torch.allclose(w, reference[name], atol=1e-6, rtol=0), name
        assert not torch.equal(w, base[name])  # the adapter did change it
    full = trainer.merged_state_dict()  # the checkpoint's export: the rest is the base itself
    assert set(full) == set(base)
    assert all(torch.equal(full[k], base[k]) for k in base if k not in merged)


def test_merge_names_the_module_an_adapter_lacks():
    base = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 3)}
    a, b = torch.zeros(2, 3), torch.zeros(4, 2)
    with pytest.raises(KeyError, match="model.layers.0.mlp.up_proj"):
        merge(base, {"model.layers.0.mlp.up_proj.lora_A": a, "model.layers.0.mlp.up_proj.lora_B": b})
    with pytest.raises(ValueError, match="lora_B"):
        merge(base, {"model.layers.0.self_attn.q_proj.lora_A": a})
    with pytest.raises(ValueError, match="does not make"):
        merge(base, {"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 5),
                     "model.layers.0.self_attn.q_proj.lora_B": b})


def test_only_the_adapters_train():
    trainer = _lora_trainer()
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in trainer.module.named_parameters()}
    assert params and all(".lora_" in names[id(p)] for p in params)
    assert sum(p.requires_grad for p in trainer.module.parameters()) == len(params) == 16


def test_lora_push_into_a_relay_holds_only_adapter_tensors(tmp_path):
    """A real relay process: the trainer pushes a full version, then a LoRA one; read back
    from the relay, the LoRA version names only `<module>.lora_A` / `.lora_B`, in a small
    fraction of the bytes, and merging it into the base gives the trainer's merged weights."""
    from dataclasses import asdict

    from laminar.bench.relay_node import RelayProcess
    from laminar.relay.client import Puller, Pusher
    from laminar.relay.plan import RelayInfo, build_chain
    from laminar.trainer.actor import RelayPush

    relay_cfg = RelayConfig()
    secret = uuid.uuid4().hex.encode()
    relay = RelayProcess("r0", f"lt{uuid.uuid4().hex[:6]}", secret, relay_cfg,
                         log_path=tmp_path / "relay.log")
    try:
        sink = RelayPush(Pusher(build_chain([RelayInfo(**asdict(relay.info))]), secret, relay_cfg))
        puller = Puller(relay.info, relay_cfg)
        full = Trainer(build_preset("tiny", seed=0), load_config(None, []).trainer, PAD_ID)
        full.push(sink, 1, relay_cfg.chunk_bytes)
        with puller.open_latest() as pulled:
            full_bytes = sum(e.nbytes for e in pulled.snapshot.header.tensors)
            assert pulled.version == 1 and "model.embed_tokens.weight" in pulled.named_tensors()
        lora = _lora_trainer()
        _random_adapters(lora)
        lora.push(sink, 2, relay_cfg.chunk_bytes)
        with puller.open_latest(newer_than=1) as pulled:
            named = {k: v.clone() for k, v in pulled.named_tensors().items()}
            lora_bytes = sum(e.nbytes for e in pulled.snapshot.header.tensors)
        sink.pusher.close()
        puller.close()
    finally:
        relay.close()
    modules = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert set(named) == {f"{m}.lora_{s}" for m in modules for s in "AB"}
    assert named["model.layers.0.self_attn.q_proj.lora_A"].shape == (8, 128)  # [r, in]
    assert named["model.layers.0.self_attn.k_proj.lora_B"].shape == (64, 8)  # [out, r]
    assert lora_bytes / full_bytes < 0.2  # tiny preset, r=8 on q/k/v/o: 57 kB of ~2 MB
    base = build_preset("tiny", seed=0).state_dict()
    merged, expected = merge(base, named), lora.merged_state_dict()
    assert all(torch.equal(merged[k], expected[k]) for k in merged)


def test_bad_lora_config_names_the_key_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules: 'qproj' .*'q_proj'"):
        _lora_trainer("trainer.lora.target_modules=[qproj]")
    with pytest.raises(ConfigError, match="'lm_head' names no linear layer .*tied"):
        _lora_trainer("trainer.lora.target_modules=[lm_head]")
    with pytest.raises(ConfigError, match="trainer.lora.r"):
        load_config(None, ["trainer.lora.r=0"])
    with pytest.raises(ConfigError, match="trainer.lora with trainer.world_size=2 needs "
                                          "trainer.sharding=none .*trainer.sharding=full"):
        load_config(None, [*LORA, "trainer.world_size=2", "cluster.backend=ray"])
    ok = load_config(None, [*LORA, "trainer.world_size=2", "cluster.backend=ray",
                            "trainer.sharding=none"])
    assert ok.trainer.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_a_lora_checkpoint_keeps_its_base_across_resume(tmp_path):
    """Checkpoint -> a trainer built from the checkpoint's merged model/ (as a resumed job's
    is) -> load: the base is the original run's (not the merged weights), the adapters and
    version come back, the rollout side finds the same W0, and mismatched configs fail."""
    base_path = _base_dir(tmp_path)
    model, tokenizer = load_pretrained(base_path)
    trainer = _lora_trainer(model=model)
    assert trainer.lora_base == str(base_path)
    _random_adapters(trainer)
    trainer.version = 3
    ckpt = trainer.save_checkpoint(tmp_path / "checkpoints" / "step_000003", tokenizer, {"steps": 3})
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora_base"] == str(base_path) and state["lora"]["r"] == 8
    assert (ckpt / "adapter" / "adapter_config.json").is_file()
    exported = load_pretrained(ckpt / "model")[0].state_dict()
    merged = trainer.merged_state_dict()
    assert all(torch.equal(exported[k], merged[k]) for k in merged)  # model/ = merged weights

    resumed = _lora_trainer(model=load_pretrained(ckpt / "model")[0])
    assert resumed.lora_base == str(base_path)  # found through ../trainer_state.json
    resumed.load_checkpoint(ckpt)
    assert resumed.version == 3
    a, b = trainer.adapter_weights(), resumed.adapter_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(merged[k], v) for k, v in resumed.merged_state_dict().items())
    w0 = LoraBase.from_model_dir(ckpt / "model", ["q_proj", "k_proj", "v_proj", "o_proj"])
    base = load_pretrained(base_path)[0].state_dict()
    assert w0.path == str(base_path) and base_dir(ckpt / "model") == base_path
    assert len(w0.weights) == 8 and all(torch.equal(w, base[k]) for k, w in w0.weights.items())
    resumed.save_checkpoint(tmp_path / "checkpoints" / "step_000004", tokenizer, {"steps": 4})
    again = json.loads((tmp_path / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert again["lora_base"] == str(base_path)  # the lineage keeps its first base

    full = Trainer(load_pretrained(ckpt / "model")[0], load_config(None, []).trainer, PAD_ID)
    with pytest.raises(ConfigError, match="holds LoRA adapters"):
        full.load_checkpoint(ckpt)
    other = _lora_trainer("trainer.lora.r=4", model=load_pretrained(ckpt / "model")[0])
    with pytest.raises(ConfigError, match="r, alpha and target_modules must match"):
        other.load_checkpoint(ckpt)


def test_start_weights_refuse_what_would_mix_bases(tmp_path):
    from laminar.modes.common import start_weights

    base_path = _base_dir(tmp_path)
    model, tokenizer = load_pretrained(base_path)
    trainer = _lora_trainer(model=model)
    ckpt = trainer.save_checkpoint(tmp_path / "ck" / "step_000001", tokenizer, {"steps": 1})
    common = ["sft.enabled=false", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match="merged export of a LoRA checkpoint"):
        start_weights(load_config(None, [*LORA, *common, f"model.path={ckpt / 'model'}"]))
    with pytest.raises(ConfigError, match="holds LoRA adapters"):
        start_weights(load_config(None, [*common, f"trainer.from_checkpoint={ckpt}"]))
    path, version = start_weights(load_config(None, [*LORA, *common, f"trainer.from_checkpoint={ckpt}"]))
    assert path == str(ckpt / "model") and version == 0
    (base_path / "config.json").unlink()  # the run's base is gone
    with pytest.raises(ConfigError, match="lora_base"):
        start_weights(load_config(None, [*LORA, *common, f"trainer.from_checkpoint={ckpt}"]))


TINY = ["sft.enabled=false", "task.reverse.max_len=8", "rollout.max_new_tokens=9",
        "rollout.group_size=2", "rollout.num_workers=2", "cluster.virtual_nodes=2",
        "rollout.batch_groups=2", "trainer.prompts_per_step=4", "trainer.threads=1",
        "rollout.engine.max_batch_size=8", "cluster.wait_timeout_s=120", "manager.interval_s=0.2",
        "task.eval_prompts=4", "trainer.lr=1e-2", *LORA]


@pytest.mark.slow  # repeats a path the default suite covers (docs/testing.md)
def test_rollouts_hold_the_trainers_merged_weights_after_a_lora_pull(tmp_path, ray_cluster):
    """Ray rollouts on two virtual nodes (one through the relay chain) pull adapter-only
    versions; each engine then holds exactly the trainer's merged weights (the adapted layers:
    W0 + B @ A, within 1e-6: the two processes may run the matmul on different thread counts;
    every other weight: the base, bit for bit)."""
    from laminar.modes import schedule
    from laminar.modes.common import start_weights
    from laminar.runtime.cluster import ClusterRuntime

    ray = ray_cluster
    cfg = load_config(None, TINY + ["mode=sync", "trainer.total_steps=2", f"run_dir={tmp_path}"])
    model_dir, _ = start_weights(cfg)
    with ClusterRuntime(cfg, model_dir, 0, schedule("sync").policy(cfg)) as rt:
        for version in (1, 2):
            for w in rt.workers.values():
                ray.get(w.generate_groups.remote(2))
            ray.get(rt.trainer.train_once.remote())
            for w in rt.workers.values():
                assert ray.get(w.sync_to.remote(version)) == version  # its own wait_timeout_s
        trained = ray.get(rt.trainer.__ray_call__.remote(lambda a: a.trainer.merged_state_dict()))
        pushed = ray.get(rt.trainer.__ray_call__.remote(lambda a: sorted(a.trainer.named_weights())))
        engines = [ray.get(w.__ray_call__.remote(
            lambda a: {k: v.clone() for k, v in a.loop.engine.model.state_dict().items()}))
            for w in rt.workers.values()]
    assert pushed and all(".lora_" in n for n in pushed)
    base = load_pretrained(model_dir)[0].state_dict()
    adapted = {n.removesuffix(".lora_A") + ".weight" for n in pushed if n.endswith(".lora_A")}
    for weights in engines:
        for name, w in trained.items():
            if name in adapted:
                assert torch.allclose(weights[name], w, atol=1e-6, rtol=0), name
                assert not torch.allclose(weights[name], base[name], atol=1e-4), name  # it trained
            else:
                assert torch.equal(weights[name], base[name]), name


@pytest.mark.slow  # repeats a path the default suite covers (docs/testing.md)
def test_a_lora_job_runs_end_to_end_exactly_once(tmp_path, ray_cluster):
    """`laminar train` with trainer.lora (laminar mode, Ray, relays): the run finishes, every
    group is trained exactly once, and its checkpoint holds the merged model, the adapter and
    the base it was trained on."""
    from laminar.modes import run_training

    cfg = load_config(None, TINY + ["mode=laminar", "trainer.total_steps=3", f"run_dir={tmp_path}"])
    report = run_training(cfg)
    assert report["exactly_once"]["ok"], report["exactly_once"]
    ckpt = tmp_path / "checkpoints" / "step_000003"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora_base"] == str(tmp_path / "initial_model")
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()
    base = load_pretrained(tmp_path / "initial_model")[0].state_dict()
    final = load_pretrained(ckpt / "model")[0].state_dict()
    changed = {k for k in base if not torch.equal(base[k], final[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in changed)


def test_bench_lora_quick_writes_its_result(tmp_path):
    """`laminar bench lora --quick` runs against a real relay process and writes the keys its
    docs and the results index read (no speed is asserted: that is the benchmark's job)."""
    from laminar.bench.lora import main

    out = tmp_path / "bench-lora.json"
    main(quick=True, out=str(out))
    result = json.loads(out.read_text())
    for key in ("push_bytes_by_variant", "push_stall_s_by_variant", "apply_s_by_variant",
                "ratios_vs_full", "provenance"):
        assert key in result, key
    assert result["push_bytes_by_variant"]["lora_r8_attn"] < result["push_bytes_by_variant"]["full"]
