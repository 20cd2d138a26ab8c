"""The `bench:` section: knobs that only shape a benchmark's workload (emulations), kept out of
the sections a training job is configured by. `laminar bench modes` sets them; a real task
never needs them."""

from __future__ import annotations

from pydantic import Field

from laminar.config.base import Section


class EnvLatencyConfig(Section):
    enabled: bool = Field(False, description="EMULATION, a benchmark knob: after generation, a "
                          "one-turn trajectory waits a random latency before its reward, as if it "
                          "called a tool. Real tools are environments (task.env, task.name=calc), "
                          "whose measured latencies are reported instead.")
    median_s: float = Field(0.5, ge=0.0, description="Median latency of one call in seconds.")
    sigma: float = Field(1.0, ge=0.0, description="Log-normal sigma (the tail: p99 ~ exp(2.33 "
                         "sigma) x median, like the paper's Fig. 2 right).")
    max_s: float = Field(10.0, gt=0.0, description="Clip of a single call's latency.")


class BenchConfig(Section):
    env_latency: EnvLatencyConfig = Field(
        default_factory=EnvLatencyConfig, description="Emulated environment (tool call) latency "
        "after each one-turn trajectory: the long-tailed waits of `laminar bench modes`.")
