"""What a schedule decides on the rollout side, as a question the loop asks every step.

    decision = policy.decide(LoopState(...))     # pure: state in, decision out

A schedule (`laminar/modes/<mode>.py`) answers three questions through its policy:
- **admit**: how many new prompt groups to lease now (`Decision.lease`), and whether groups
  already leased may start (`Decision.start`);
- **pull**: whether to load the newest weights now (`Decision.pull`; only with nothing
  decoding, so a trajectory keeps one version);
- **in-flight work on a new version**: finish it first (`Decision.draining`: the rollout is in
  its ramp-down and may be repacked), or interrupt it, swap the weights and resume it
  (`Decision.interrupt`: one trajectory then mixes versions, as partial rollout does).

Four attributes say what the rest of the system may do (the runtimes read them, and nothing
else of a policy but `decide`):
- `mixes_versions`: may a rollout's unfinished work continue on other weights (resumed after an
  interrupt, or adopted by a rollout of another version on failover);
- `repacks`: may the manager move a draining rollout's tail to a same-version peer;
- `max_outstanding`: how many groups leased or untrained the prompt pool allows (None: no
  bound; admission control);
- `defers_resumed`: a resumed job's in-flight work waits until the driver hands it out
  (`resume_global_batches`) instead of going to the rollouts before the loops start.
`RolloutLoop` (loop.py) applies the decisions; it never asks which mode it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LoopState:
    """What a policy sees: one rollout, now."""

    version: int  # weights the engine holds
    newest: int | None  # newest complete version the weight source offers (None: none yet)
    sync_to: int | None  # a version a global weight sync asked for that the engine lacks
    num_in_flight: int  # trajectories decoding
    num_leased: int  # groups leased and not started
    num_requested: int  # groups of a requested global batch not leased yet
    free_groups: int  # groups that fit before the rollout's own batch (rollout.batch_groups) is full
    held: bool  # the manager holds this rollout's admissions (a repack source, until released)

    @property
    def sync_ready(self) -> bool:
        """The version a global sync asked for has reached this rollout's weight source."""
        return self.sync_to is not None and self.newest is not None and self.newest >= self.sync_to


@dataclass(frozen=True, slots=True)
class Decision:
    lease: int = 0  # prompt groups to ask the prompt source for now
    start: bool = True  # start the groups already leased
    pull: bool = False  # load the newest version now (done only while nothing decodes)
    interrupt: bool = False  # abort in-flight work, load the newest version, resume it all
    draining: bool = False  # admitting nothing until in-flight work is done (a repack candidate)


class Policy(Protocol):
    mixes_versions: bool  # may a trajectory continue on weights other than its first version
    repacks: bool  # may the manager move a draining rollout's unfinished work to a peer
    max_outstanding: int | None  # groups leased or untrained the prompt pool allows (None: any)
    defers_resumed: bool  # a resumed job's in-flight work waits for the driver to hand it out

    def decide(self, state: LoopState) -> Decision: ...
