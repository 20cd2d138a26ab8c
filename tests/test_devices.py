"""laminar/devices.py: `device` settings, the start check, staged host -> device copies (the
packing logic on the CPU), and the trainer on the resolved device."""

from __future__ import annotations

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
    # but Ray hides the GPU from a trainer actor that reserves none
    with pytest.raises(ConfigError, match=r"cluster.trainer_resources=\{GPU: 1\}"):
        check_devices(load_config(None, ["trainer.device=cuda", "cluster.address=auto"]))
    reserved = ["trainer.device=cuda", "cluster.address=auto", "cluster.trainer_resources={GPU: 0.5}"]
    assert check_devices(load_config(None, reserved)) == {}


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
