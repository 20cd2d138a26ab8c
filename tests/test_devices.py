"""laminar/devices.py: `device` settings, the start check, staged host -> device copies (the
packing logic on the CPU), and the trainer on the resolved device."""

from __future__ import annotations

import os

import pytest
import torch

from laminar import devices
from laminar.config import ConfigError, TrainerConfig, load_config
from laminar.devices import (StagingBuffer, check_devices, load_into_module, resolve_device,
                             stage_copy, to_host)


def test_settings_resolve_on_this_machine():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cuda_without_cuda_is_one_line_naming_key_value_and_fix(monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    assert resolve_device("auto", "rollout.device").type == "cpu"
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda", "trainer.device")
    msg = str(e.value)
    assert "\n" not in msg
    assert "trainer.device=cuda" in msg and "trainer.device=cpu" in msg and "auto" in msg
    with pytest.raises(ConfigError, match="not a device setting"):
        resolve_device("tpu", "trainer.device")


def test_config_fields_and_validator():
    cfg = load_config(None, ["trainer.device=CPU", "rollout.device= cuda "])
    assert (cfg.trainer.device, cfg.rollout.device) == ("cpu", "cuda")
    assert load_config(None).trainer.device == "auto" and load_config(None).rollout.device == "auto"
    with pytest.raises(ConfigError, match="rollout.device.*say cuda"):
        load_config(None, ["rollout.device=gpu"])
    with pytest.raises(ConfigError, match="not cuda:N"):
        load_config(None, ["trainer.device=cuda:1"])


def test_check_devices_at_start(monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    assert check_devices(load_config(None)) == {"trainer.device": "cpu", "rollout.device": "cpu"}
    with pytest.raises(ConfigError, match="rollout.device=cuda"):
        check_devices(load_config(None, ["rollout.device=cuda"]))
    # on a cluster the trainer and rollouts may run where there are GPUs: not judged here
    assert check_devices(load_config(None, ["rollout.device=cuda", "cluster.address=auto"])) == {}


def test_cli_refuses_cuda_without_a_traceback(monkeypatch, capsys):
    from laminar.cli import main

    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    assert main(["train", "examples/reverse.yaml", "trainer.device=cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("laminar: trainer.device=cuda") and "Traceback" not in err
    assert len(err.splitlines()) == 1


def _named(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(37, 5, generator=g), "b": torch.randn(3, generator=g),
            "c": torch.randint(0, 100, (1000,), generator=g), "empty": torch.zeros(0),
            "d": torch.randn(64, 64, generator=g).to(torch.bfloat16)}


@pytest.mark.parametrize("nbytes", [128, 1024, 1 << 20])
def test_stage_copy_through_a_small_buffer_equals_copy(nbytes):
    """A buffer smaller than one tensor: pieces, both halves in turn; dtypes converted."""
    src = _named(1)
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    dst["d"] = torch.empty(64, 64, dtype=torch.float32)  # the engine's dtype differs from the relay's
    staging = StagingBuffer.allocate(nbytes, pin=False)
    n = stage_copy(dst, src, staging)
    assert n == sum(v.numel() * v.element_size() for v in src.values())
    for k in src:
        assert torch.equal(dst[k], src[k].to(dst[k].dtype)), k


def test_stage_copy_without_staging_and_errors():
    src = _named(2)
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    stage_copy(dst, src, None)
    assert all(torch.equal(dst[k], src[k]) for k in src)
    with pytest.raises(ValueError, match="shape"):
        stage_copy({"a": torch.empty(5, 37)}, src)
    with pytest.raises(ValueError, match="lack"):
        stage_copy({"zz": torch.empty(1)}, src)
    assert StagingBuffer.for_device(torch.device("cpu")) is None


@pytest.mark.filterwarnings("ignore:.*not writable")
def test_load_into_module_from_read_only_shared_memory_views():
    """What the engine does with a pulled relay version: views of read-only memory in, the
    module's own tensors (on its device) out; tied weights stay tied."""
    import numpy as np

    from laminar.models import build_preset

    src_model, dst_model = build_preset("tiny", seed=1), build_preset("tiny", seed=2)
    blob = {}
    for k, v in src_model.state_dict().items():
        raw = np.frombuffer(v.detach().numpy().tobytes(), dtype=np.uint8)  # read-only
        blob[k] = torch.from_numpy(raw).view(v.dtype).reshape(v.shape)
    load_into_module(dst_model, blob, StagingBuffer.allocate(4096, pin=False))
    for (k, a), b in zip(src_model.state_dict().items(), dst_model.state_dict().values()):
        assert torch.equal(a, b), k
    assert dst_model.lm_head.weight.data_ptr() == dst_model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="missing"):
        load_into_module(dst_model, {"x": torch.zeros(1)})


def test_trainer_places_its_model_on_the_resolved_device(monkeypatch):
    from laminar.models import build_preset
    from laminar.trainer.trainer import Trainer

    t = Trainer(build_preset("tiny"), TrainerConfig(device="cpu"), pad_token_id=0)
    assert t.device.type == "cpu" and next(t.module.parameters()).device.type == "cpu"
    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.device=cuda"):
        Trainer(build_preset("tiny"), TrainerConfig(device="cuda"), pad_token_id=0)


def test_trainer_hands_host_tensors_to_a_keeping_sink():
    """A sink without push_parts (the one-process board) keeps what it is handed: host tensors;
    on the CPU they are views (no copy), as before."""
    from laminar.models import build_preset
    from laminar.trainer.trainer import Trainer

    got = {}

    class Keep:
        def push(self, named, version):
            got.update(named)
            return 0.0

    t = Trainer(build_preset("tiny"), TrainerConfig(device="cpu"), pad_token_id=0)
    t.push(Keep(), 1, 1 << 20)
    assert got and all(v.device.type == "cpu" for v in got.values())
    p = dict(t.module.named_parameters())
    assert all(got[k].data_ptr() == p[k].data_ptr() for k in got)
    assert to_host(got)["model.norm.weight"].data_ptr() == p["model.norm.weight"].data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_copy_into_cuda_through_pinned_halves():
    src = _named(3)
    dev = resolve_device("cuda")
    dst = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in src.items()}
    staging = StagingBuffer.for_device(dev, 1024)
    assert staging is not None and staging.pinned
    stage_copy(dst, src, staging)
    assert all(torch.equal(dst[k].cpu(), src[k]) for k in src)


# ------------------------------------------------------------------------ the rollout side


def test_cuda_under_ray_needs_a_gpu_reserved():
    """Ray hides GPUs from a trainer or rollout actor that reserves none: refused at start, one
    line with the key, the value and the fix."""
    from laminar.runtime.assembly import check_gpu_reservations

    for role in ("trainer", "rollout"):
        with pytest.raises(ConfigError) as e:
            check_gpu_reservations(load_config(None, [f"{role}.device=cuda"]))
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"{role}.device=cuda with cluster.backend=ray")
        assert f"cluster.{role}_resources={{GPU: 1}}" in msg and "0.5" in msg
        with pytest.raises(ConfigError, match=f"{role}_resources"):  # a custom resource is no GPU
            check_gpu_reservations(load_config(None, [f"{role}.device=cuda",
                                                      f"cluster.{role}_resources={{accel: 1, GPU: 0}}"]))
        for ok in ([f"{role}.device=cuda", f"cluster.{role}_resources={{GPU: 0.5}}"],
                   [f"{role}.device=cuda", "cluster.backend=local"],  # one process: sees every GPU
                   [f"{role}.device=auto"], [f"{role}.device=cpu"]):
            check_gpu_reservations(load_config(None, ok))
    assert load_config(None).cluster.rollout_resources == {}


def test_resources_become_ray_options_ray_accepts():
    """Ray takes CPUs and GPUs as num_cpus / num_gpus and refuses them inside `resources`: a
    trainer or rollout reserving {GPU: 0.5} must not fail at `.options()`."""
    import ray

    from laminar.runtime.raytools import THREADED, ray_resources

    assert ray_resources({}) == {}
    opts = ray_resources({"GPU": 0.5, "CPU": 2, "accel": 1})
    assert opts == {"num_gpus": 0.5, "num_cpus": 2.0, "resources": {"accel": 1.0}}

    class Actor:
        pass

    ray.remote(Actor).options(**{**THREADED, **opts})  # validated here, no cluster needed
    with pytest.raises(ValueError, match="num_gpus"):  # what a raw mapping did
        ray.remote(Actor).options(resources={"GPU": 0.5})


def _tokenizer():
    from types import SimpleNamespace

    return SimpleNamespace(eos_token_id=1, pad_token_id=0)


def test_engine_factory_places_the_native_engine_on_rollout_device(monkeypatch):
    from laminar.models import build_preset
    from laminar.rollout.build import engine_factory

    cfg = load_config(None, ["rollout.device=cpu"])
    engine = engine_factory(cfg, "unused", _tokenizer(), 3, 0)(build_preset("tiny"))
    assert engine.runner.device.type == "cpu" and engine.staging is None and engine.version == 3
    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="rollout.device=cuda"):  # in the rollout's process
        engine_factory(load_config(None, ["rollout.device=cuda"]), "unused", _tokenizer(), 0, 0)


def test_engine_loads_through_a_staging_buffer_as_with_plain_copies():
    """The native engine's load_weights with a (small, unpinned) staging buffer, the packing
    path a GPU takes: same weights as the plain copies, a partial load touches only its names,
    and a bad name or shape is refused before anything is copied."""
    from laminar.engine.engine import Engine
    from laminar.models import build_preset

    src = build_preset("tiny", seed=1).state_dict()
    staged, plain = (Engine(build_preset("tiny", seed=2), 1, 0) for _ in range(2))
    staged.staging = StagingBuffer.allocate(4096, pin=False)
    staged.load_weights(src, 1)
    plain.load_weights(iter(src.items()), 1)
    for (k, a), b in zip(staged.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, src[k]), k
    assert staged.version == plain.version == 1
    before = {k: v.clone() for k, v in staged.model.state_dict().items()}
    name = "model.norm.weight"
    with pytest.raises(KeyError, match="not a tensor of this model"):
        staged.load_weights({name: torch.zeros_like(src[name]), "nope": torch.zeros(1)}, 2)
    with pytest.raises(ValueError, match="the model expects"):
        staged.load_weights({name: torch.zeros_like(src[name]), "lm_head.weight": torch.zeros(2)}, 2)
    assert all(torch.equal(before[k], v) for k, v in staged.model.state_dict().items())
    assert staged.version == 1
    staged.load_weights({name: torch.zeros_like(src[name])}, 2)
    assert not staged.model.state_dict()[name].any() and staged.version == 2


def test_copy_into_module_keeps_its_messages_and_stages():
    from laminar.models import build_preset
    from laminar.relay.client import copy_into_module

    src, dst = build_preset("tiny", seed=1), build_preset("tiny", seed=2)
    copy_into_module(dst, src.state_dict(), StagingBuffer.allocate(1024, pin=False))
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    with pytest.raises(ValueError, match="pulled weights do not match the model"):
        copy_into_module(dst, {"x": torch.zeros(1)})
    bad = dict(src.state_dict(), **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="pulled tensor 'model.norm.weight' has shape"):
        copy_into_module(dst, bad)


def test_lora_merge_follows_w0s_device_and_dtype():
    """Adapters come from host shared memory; W0 may live on the engine's device (the meta
    device stands in for a GPU here: a product across devices would raise)."""
    from laminar.engine.lora import merge

    w0 = torch.zeros(4, 3, dtype=torch.bfloat16, device="meta")
    adapters = {"m.lora_A": torch.ones(2, 3), "m.lora_B": torch.ones(4, 2)}
    w = merge({"m.weight": w0}, adapters)["m.weight"]
    assert w.device.type == "meta" and w.dtype == torch.bfloat16 and w.shape == (4, 3)
    host = merge({"m.weight": torch.zeros(4, 3)}, adapters)["m.weight"]
    assert torch.equal(host, torch.full((4, 3), 2.0))


# ----------------------------------------------------------------------------- cluster.cpu_affinity

def test_cpu_plan_gives_trainer_and_rollouts_disjoint_cores():
    from laminar.devices import cpu_plan

    cores = list(range(16))
    trainer = cpu_plan(cores, 4, None, 3)
    rollouts = [cpu_plan(cores, 4, i, 3) for i in range(3)]
    assert trainer == [0, 1, 2, 3]
    assert rollouts == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # uneven: the first rollouts take one more; nothing shared, nothing left over
    uneven = [cpu_plan(list(range(8)), 3, i, 2) for i in range(2)]
    assert uneven == [[3, 4, 5], [6, 7]]
    # default: half the cores for the trainer; two cores, two rollouts: they share the second
    assert cpu_plan([0, 1], None, None, 2) == [0]
    assert cpu_plan([0, 1], None, 0, 2) == cpu_plan([0, 1], None, 1, 2) == [1]
    # more rollouts than cores left: round-robin; a later joiner takes its slot's cores
    assert [cpu_plan([0, 1, 2, 3], 1, i, 5)[0] for i in range(5)] == [1, 2, 3, 1, 2]
    assert cpu_plan(cores, 4, 4, 3) == rollouts[1]


def test_cpu_plan_without_a_core_for_rollouts_names_the_key():
    from laminar.devices import cpu_plan

    with pytest.raises(ConfigError, match="cluster.trainer_cpus=2.*cluster.cpu_affinity=off"):
        cpu_plan([0, 1], 2, None, 2)
    with pytest.raises(ConfigError, match="1 core"):
        cpu_plan([0], None, 0, 1)


def test_cpu_affinity_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="cluster.cpu_affinity=split.*cluster.backend=local"):
        load_config(None, ["cluster.cpu_affinity=split", "cluster.backend=local"])
    with pytest.raises(ConfigError, match="cluster.address"):
        load_config(None, ["cluster.cpu_affinity=split", "cluster.address=auto"])


def _affinity_after_pin(cfg, index, out):
    from laminar.devices import pin_cpus

    out.put((pin_cpus(cfg, index), sorted(os.sched_getaffinity(0))))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_cpus_pins_a_real_process():
    import multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    cfg = load_config(None, ["cluster.cpu_affinity=split", "rollout.num_workers=2"])
    ctx = mp.get_context("spawn")
    for index, expected in ((None, cores[:max(1, len(cores) // 2)]),
                            (1, devices.cpu_plan(cores, None, 1, 2))):
        out = ctx.Queue()
        p = ctx.Process(target=_affinity_after_pin, args=(cfg, index, out))
        p.start()
        pinned, seen = out.get(timeout=60)
        p.join(timeout=60)
        assert pinned == seen == expected
    assert sorted(os.sched_getaffinity(0)) == cores  # this process untouched
    off = load_config(None, ["cluster.cpu_affinity=off"])
    assert devices.pin_cpus(off, 0) is None
    assert devices.rollout_index("rollout3.2") == 3 and devices.rollout_index("rollout12") == 12


def _leave_then_start(cfg, out):
    """A driver: leaves the trainer's cores, then starts a trainer and a plain process."""
    import multiprocessing as mp

    from laminar.devices import leave_trainer_cores

    rest = leave_trainer_cores(cfg)
    ctx = mp.get_context("spawn")  # started after, as Ray's daemons and workers are
    q = ctx.Queue()
    trainer = ctx.Process(target=_affinity_after_pin, args=(cfg, None, q))
    trainer.start()
    pinned = q.get(timeout=60)
    trainer.join(timeout=60)
    plain = ctx.Process(target=_affinity_of, args=(q,))
    plain.start()
    other = q.get(timeout=60)
    plain.join(timeout=60)
    out.put((rest, sorted(os.sched_getaffinity(0)), pinned, other))


def _affinity_of(out):
    out.put(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_split_keeps_every_other_process_off_the_trainers_cores():
    """The driver leaves the trainer's cores before it starts anything: what it starts later
    runs on the others, the trainer still gets its own (from $LAMINAR_JOB_CPUS, not from the
    narrower affinity it inherited)."""
    import multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    cfg = load_config(None, ["cluster.cpu_affinity=split", "rollout.num_workers=2"])
    trainer = devices.cpu_plan(cores, None, None, 2)
    rest = [c for c in cores if c not in trainer]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    driver = ctx.Process(target=_leave_then_start, args=(cfg, out))
    driver.start()
    left, driver_now, (pinned, seen), other = out.get(timeout=120)
    driver.join(timeout=60)
    assert left == driver_now == other == rest
    assert pinned == seen == trainer
    assert sorted(os.sched_getaffinity(0)) == cores and devices.CPUS_ENV not in os.environ
    off = load_config(None, ["cluster.cpu_affinity=off"])
    assert devices.leave_trainer_cores(off) is None  # off: nothing moves


def test_auto_affinity_splits_where_a_cluster_would_give_the_trainer_its_own_devices():
    """cluster.cpu_affinity=auto, the pure decision: lend (split, the trainer's cores the
    rollouts' while it waits) for a schedule that trains while
    rollouts generate, on the CPU, with the native engine on the embedded cluster and a
    trainer whose threads fit its share; off otherwise, saying why."""
    plan = devices.affinity_plan
    assert load_config(None, []).cluster.cpu_affinity == "auto"  # the default
    laminar = ["mode=laminar", "trainer.threads=1", "rollout.num_workers=2", "cluster.cpu_affinity=auto"]
    cfg = load_config(None, laminar)
    choice, why = plan(cfg, [0, 1], True, True)
    assert choice == "lend" and "[0]" in why and "waits" in why
    for mode in ("one_step", "stream", "partial"):
        assert plan(load_config(None, [*laminar, f"mode={mode}"]), [0, 1], True, True)[0] == "lend"
    offs = {
        "sync": (load_config(None, [*laminar, "mode=sync"]), [0, 1], True, True),
        "GPU": (cfg, [0, 1], False, True),
        "rollout.engine.backend=vllm": (load_config(None, [*laminar, "rollout.engine.backend=vllm"]),
                                        [0, 1], True, True),
        "cluster.backend=local": (load_config(None, [*laminar, "mode=one_step",
                                                     "cluster.backend=local"]), [0, 1], True, True),
        "cluster.address": (load_config(None, [*laminar, "cluster.address=auto"]), [0, 1], True, True),
        "would leave none of this process's 1": (cfg, [0], True, True),
        "cannot pin": (cfg, [0, 1], True, False),
        "set trainer.threads lower": (load_config(None, [*laminar, "trainer.threads=2"]),
                                      [0, 1], True, True),
        "need more than its cluster.trainer_cpus=1": (
            load_config(None, [*laminar, "trainer.threads=2", "cluster.trainer_cpus=1"]),
            [0, 1, 2, 3], True, True),
        "cluster.cpu_affinity=off": (load_config(None, [*laminar, "cluster.cpu_affinity=off"]),
                                     [0, 1], True, True),
        # another job here pins its trainer where this one's would go: both would share it
        "another laminar job (pid 4242, core(s) [0])": (cfg, [0, 1], True, True, {4242: [0]}),
    }
    for reason, args in offs.items():
        choice, why = plan(*args)
        assert choice == "off" and reason in why, (reason, why)
    assert plan(cfg, [0, 1, 2, 3], True, True, {4242: [3]})[0] == "lend"  # not its trainer's core
    assert plan(cfg, [2, 3], True, True, {4242: [0]})[0] == "lend"  # taskset: cores of its own
    split = load_config(None, [*laminar, "cluster.cpu_affinity=split"])
    assert plan(split, [0, 1], True, True, {4242: [0]})[0] == "split"  # asked for: as asked
    # the trainer gets as many cores as its threads (a cluster gives it the devices it uses),
    # not half of a big machine: two threads on eight cores, two ranks of one thread each
    two = load_config(None, [*laminar, "trainer.threads=2"])
    assert plan(two, list(range(8)), True, True) == (
        "lend", "cluster.cpu_affinity=auto: lend: the trainer on core(s) [0, 1], the rollouts on "
        "the rest and on the trainer's while it waits for data")
    ranks = load_config(None, [*laminar, "trainer.world_size=2"])
    assert "core(s) [0, 1]," in plan(ranks, list(range(8)), True, True)[1]
    # cluster.trainer_cpus, when set, is the share
    wide = load_config(None, [*laminar, "cluster.trainer_cpus=3"])
    assert "core(s) [0, 1, 2]," in plan(wide, list(range(8)), True, True)[1]
    # asked-for split splits whatever the mode
    asked = load_config(None, ["mode=sync", "cluster.cpu_affinity=split"])
    assert plan(asked, [0, 1], False, True)[0] == "split"
    assert plan(asked, [0, 1], True, False)[0] == "off"  # where the OS cannot pin


def test_settle_affinity_decides_once_without_touching_the_users_config():
    cfg = load_config(None, ["mode=sync", "cluster.cpu_affinity=auto"])
    settled, why = devices.settle_affinity(cfg)
    assert settled.cluster.cpu_affinity == "off" and "sync" in why
    assert cfg.cluster.cpu_affinity == "auto"
    off = load_config(None, ["cluster.cpu_affinity=off"])
    assert devices.settle_affinity(off)[0] is off
    # auto that lends fixes the trainer's share for every process: its threads' worth
    lends = load_config(None, ["mode=laminar", "trainer.threads=1", "cluster.cpu_affinity=auto"])
    if len(devices.job_cores()) >= 2 and devices.cpu_affinity(lends)[0] == "lend":
        settled, _ = devices.settle_affinity(lends)
        assert (settled.cluster.cpu_affinity, settled.cluster.trainer_cpus) == ("lend", 1)
        assert lends.cluster.trainer_cpus is None


def _tool_affinity(cores, out):
    """A pinned rollout: the job's cores recorded, this process on the last one; its sandbox's
    tool program reports the cores it may use."""
    from laminar.config import SandboxConfig
    from laminar.cores import CPUS_ENV
    from laminar.sandbox import Sandbox

    os.environ[CPUS_ENV] = ",".join(map(str, cores))
    os.sched_setaffinity(0, cores[-1:])
    sb = Sandbox(SandboxConfig())
    try:
        r = sb.run("import os; print(sorted(os.sched_getaffinity(0)))")
        out.put((r.status, r.stdout.strip(), sorted(os.sched_getaffinity(0))))
    finally:
        sb.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_tool_programs_of_a_pinned_rollout_run_on_all_the_jobs_cores():
    import multiprocessing as mp

    from laminar.sandbox import probe

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    if probe("unshare") is not None and probe("bwrap") is not None:
        pytest.skip("no sandbox backend works here")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_tool_affinity, args=(cores, out))
    p.start()
    status, printed, host = out.get(timeout=120)
    p.join(timeout=60)
    assert status == "ok" and printed == str(cores)
    assert host == cores[-1:]


def _narrowed_then(cfg_args, cores, out):
    """A Ray worker started by a driver that left the trainer's cores: pin_cpus of an unsplit
    job gives it every core of the job back; restore_cores undoes leave_trainer_cores."""
    from laminar.cores import CPUS_ENV

    if cfg_args is None:
        split = load_config(None, ["cluster.cpu_affinity=split", "rollout.num_workers=2"])
        left = devices.leave_trainer_cores(split)
        devices.restore_cores()
        out.put((left, sorted(os.sched_getaffinity(0)), CPUS_ENV in os.environ))
        return
    os.environ[CPUS_ENV] = ",".join(map(str, cores))
    os.sched_setaffinity(0, cores[-1:])
    pinned = devices.pin_cpus(load_config(None, cfg_args), 0)
    out.put((pinned, sorted(os.sched_getaffinity(0)), CPUS_ENV in os.environ))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_unsplit_processes_take_the_jobs_cores_back():
    import multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    ctx = mp.get_context("spawn")
    results = []
    for args in (["mode=sync"], None):
        out = ctx.Queue()
        p = ctx.Process(target=_narrowed_then, args=(args, cores, out))
        p.start()
        results.append(out.get(timeout=60))
        p.join(timeout=60)
    assert results[0] == (None, cores, True)  # sync: not pinned, every core again
    left, after, env = results[1]
    assert left == cores[max(1, len(cores) // 2):] and after == cores and not env


def _borrowing_rollout(path, own, wide, ready, stop):
    """A rollout's loop in miniature: a second thread, and the borrower polled every ms."""
    import threading
    import time

    from laminar.cores import Borrower

    os.sched_setaffinity(0, own)
    threading.Thread(target=stop.wait, daemon=True).start()  # a thread started before a move
    b = Borrower(path, own, wide)
    ready.set()
    while not stop.is_set():
        b.poll()
        time.sleep(0.001)


def _affinities(pid):
    return {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_rollout_borrows_the_trainers_cores_only_while_the_trainer_waits(tmp_path):
    """cluster.cpu_affinity=lend with a real second process: every thread of the rollout moves
    onto the trainer's cores when the trainer lends them and off them when it trains again;
    the flag is gone after close."""
    import multiprocessing as mp
    import time

    from laminar.cores import TrainerLoan, loan_path

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    own, wide = cores[-1:], cores
    path = loan_path(tmp_path)
    loan = TrainerLoan(path)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_borrowing_rollout, args=(path, own, wide, ready, stop))
    p.start()
    try:
        assert ready.wait(60)

        def settles_on(expected):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if _affinities(p.pid) == {tuple(expected)}:
                    return True
                time.sleep(0.005)
            return False

        assert settles_on(own)
        loan.lend(True)
        assert settles_on(wide)
        loan.lend(False)
        assert settles_on(own)
    finally:
        stop.set()
        p.join(timeout=30)
        loan.close()
    assert not os.path.exists(path)


def test_lend_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="cluster.cpu_affinity=lend.*cluster.backend=local"):
        load_config(None, ["cluster.cpu_affinity=lend", "cluster.backend=local"])


def test_cpu_sched_is_normal_unless_asked():
    assert load_config(None, []).rollout.cpu_sched == "normal"
    assert load_config(None, ["rollout.cpu_sched=idle"]).rollout.cpu_sched == "idle"
    with pytest.raises(ConfigError, match="cpu_sched"):
        load_config(None, ["rollout.cpu_sched=lazy"])


def _policies_after_yield(out):
    import threading

    stop = threading.Event()
    early = threading.Thread(target=stop.wait)  # a thread that exists before (Ray's, vLLM's)
    early.start()
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    moved = devices.yield_cpu(3, "idle")
    seen = [os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")]
    later: list[int] = []
    late = threading.Thread(target=lambda: later.append(os.sched_getscheduler(0)))
    late.start()
    late.join()
    stop.set()
    early.join()
    out.put((moved, seen, later[0], os.getpriority(os.PRIO_PROCESS, 0) - nice))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")
def test_yield_cpu_puts_every_thread_of_a_real_process_under_sched_idle():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_policies_after_yield, args=(out,))
    p.start()
    moved, seen, later, raised = out.get(timeout=60)
    p.join(timeout=60)
    assert moved >= 2 and len(seen) >= 2
    assert set(seen) == {os.SCHED_IDLE} and later == os.SCHED_IDLE and raised == 3
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this process untouched
    assert devices.yield_cpu(0, "normal") == 0


def test_a_jobs_trainer_cores_are_seen_by_the_other_jobs_while_its_driver_lives(tmp_path, monkeypatch):
    """The registry behind `auto`'s check: a claim is seen by other processes, not by its own;
    a driver SIGKILLed without releasing leaves a file that no longer counts."""
    import signal
    import subprocess
    import sys
    import textwrap

    from laminar import cores

    monkeypatch.setenv(cores.CLAIMS_ENV, str(tmp_path))
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from laminar.cores import claim_trainer_cores
        claim_trainer_cores([0, 1])
        print("claimed", flush=True)
        time.sleep(600)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "claimed"
        assert cores.other_trainer_cores() == {other.pid: [0, 1]}
        cores.claim_trainer_cores([2])
        assert os.getpid() not in cores.other_trainer_cores()  # our own is not another job's
        cfg = load_config(None, ["mode=laminar", "trainer.threads=1", "cluster.cpu_affinity=auto"])
        if len(cores.job_cores()) >= 2 and cores.job_cores()[0] in (0, 1):
            choice, why = devices.cpu_affinity(cfg)
            assert choice == "off" and f"pid {other.pid}" in why and "taskset" in why
        os.kill(other.pid, signal.SIGKILL)
        other.wait()
        assert (tmp_path / str(other.pid)).exists() and cores.other_trainer_cores() == {}
    finally:
        other.kill()
        cores.release_trainer_cores()
    assert not (tmp_path / str(os.getpid())).exists()
