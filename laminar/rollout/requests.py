"""From a leased prompt group to engine requests: one request per sample, the config's
sampling parameters, the trajectory id `group_id/sample` as the request id."""

from __future__ import annotations

from laminar.config import Config
from laminar.types import GenerationRequest, PromptGroup, SamplingParams


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens)


def group_requests(group: PromptGroup, params: SamplingParams) -> list[GenerationRequest]:
    return [GenerationRequest(f"{group.group_id}/{i}", list(group.prompt_ids), params)
            for i in range(group.num_samples)]
