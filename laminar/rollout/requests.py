"""From a leased prompt group to engine requests: one request per sample, the config's
sampling parameters, the trajectory id `group_id/sample` as the request id.

Each request gets its own sampling seed, derived from the run's seed and its trajectory id, so
a trajectory's draws do not depend on which rollout generates it or on what ran before: a
re-issued, repacked or resumed trajectory samples what it would have sampled anyway, and a run
resumed from a checkpoint repeats the next step exactly.
"""

from __future__ import annotations

import dataclasses
import zlib

from laminar.config import Config
from laminar.types import GenerationRequest, PromptGroup, SamplingParams


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, seed=cfg.trainer.seed)


def group_requests(group: PromptGroup, params: SamplingParams) -> list[GenerationRequest]:
    """`params.seed` is the run's seed; each sample's own seed is derived from it."""
    out = []
    for i in range(group.num_samples):
        rid = f"{group.group_id}/{i}"
        seed = zlib.crc32(f"{params.seed}/{rid}".encode())
        out.append(GenerationRequest(rid, list(group.prompt_ids), dataclasses.replace(params, seed=seed)))
    return out
