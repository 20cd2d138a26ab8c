"""How trajectories become the trainer's batches.

- `split_groups`: a global batch into mini-batches of whole groups;
- `token_budget_batches`: micro-batches by token budget: sort sequences by length and cut them
  into groups whose padded size (rows x longest row) stays under a budget. On long-tailed
  lengths this removes most of the padding a random batch would carry (one 140-token sample no
  longer pads 63 short ones);
- `collate`: trajectories packed into right-padded tensors (`Batch`) with the behaviour
  log-probs aligned to the positions that predict each response token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from laminar.types import Trajectory


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, grouped; each group has len(group) * max(length) <= max_tokens,
    except that a single sequence longer than the budget forms a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending, so lengths[i] is the longest of `current + [i]`
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] input_ids shifted left: the token each position predicts
    response_mask: torch.Tensor  # [B, L-1] 1 where the target is a response token
    old_logprobs: torch.Tensor  # [B, L-1] behaviour log-probs at the response positions
    advantages: torch.Tensor  # [B]
    token_versions: torch.Tensor  # [B, L-1] the weight version that sampled each response
    # token (read under response_mask; 0 elsewhere)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def collate(trajs: list[Trajectory], advantages: torch.Tensor, pad_token_id: int) -> Batch:
    width = max(t.num_tokens for t in trajs)
    B = len(trajs)
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    response_mask = torch.zeros((B, width - 1))
    old_logprobs = torch.zeros((B, width - 1))
    token_versions = torch.zeros((B, width - 1), dtype=torch.long)
    for row, t in enumerate(trajs):
        seq = t.prompt_ids + t.response_ids
        input_ids[row, :len(seq)] = torch.tensor(seq)
        attention_mask[row, :len(seq)] = 1
        start = len(t.prompt_ids) - 1  # position whose logits predict the first response token
        end = start + len(t.response_ids)
        response_mask[row, start:end] = (1.0 if t.loss_mask is None else  # observations: context
                                          torch.tensor(t.loss_mask, dtype=torch.float32))
        old_logprobs[row, start:end] = torch.tensor(t.logprobs, dtype=torch.float32)
        mixed = t.token_versions is not None and len(t.token_versions) == len(t.response_ids)
        token_versions[row, start:end] = torch.tensor(t.token_versions) if mixed else t.version
    return Batch(input_ids, attention_mask, input_ids[:, 1:], response_mask, old_logprobs,
                 advantages, token_versions)


def split_groups(trajs: list[Trajectory], parts: int) -> list[list[Trajectory]]:
    """Split into `parts` mini-batches of whole groups (a group's advantages belong together)."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    ordered = list(groups.values())
    size = -(-len(ordered) // parts)
    return [[t for g in ordered[i:i + size] for t in g] for i in range(0, len(ordered), size)]
