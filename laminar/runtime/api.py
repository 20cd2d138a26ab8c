"""The driver API: what a schedule's driver (laminar/modes/<mode>.py) and its follower drive,
the same on a Ray cluster (cluster.py, `ClusterRuntime`) and in one process (local.py,
`LocalRuntime`). tests/test_runtime_api.py checks that both have every method, with these
parameters.

A call that runs while the driver goes on returns a `Pending` (a Ray ObjectRef, or a list of
them, on a cluster; `Done` in one process); `wait`, `ready` and `result` take it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

from laminar.config import Config
from laminar.pools.resume import ResumeSummary
from laminar.types import RolloutSnapshot

if TYPE_CHECKING:  # types only: both import torch, and the pools' processes import this package
    from laminar.rollout.evals import EvalJob
    from laminar.tasks import Task

Pending: TypeAlias = Any  # a call in flight: only the runtime that made it reads it
TrainerCall: TypeAlias = Literal["train_once", "train_streaming", "train_next", "run"]

ONE_PROCESS_SCALE = ("the local backend (one process) cannot add or remove rollouts; run with "
                     "cluster.backend=ray")


class TrainerRestarted(RuntimeError):
    """The trainer died during a call; it restarts from its newest checkpoint, so the driver
    makes the call again."""


class Runtime(Protocol):
    cfg: Config
    start_version: int  # the version of the weights every component starts with
    started_at: float  # unix time the rollouts were started: the run's rows count from it
    task: Task  # its held-out set is what `request_eval` evaluates
    job: str | None  # the job's id (None: one process)
    resumed: ResumeSummary | None  # a resumed job: what the reconciliation did (None: not said)
    one_process: bool  # no processes to name, no nodes, no elasticity: the operator views
    #                    and `scale_up` / `retire_worker` are never asked

    def __enter__(self) -> Runtime: ...

    def __exit__(self, *exc: object) -> None: ...

    # --- the schedule's waits
    def generate(self, num_groups: int) -> Pending:
        """Deal one global batch out to the live rollouts, evenly."""

    def sync_weights(self, version: int) -> None:
        """Every rollout gets to `version` (its policy says how) before this returns."""

    def train(self, method: TrainerCall) -> Pending:
        """Start a trainer call (TrainerService's method of that name; `run` to the end)."""

    def wait(self, pending: Pending, what: str) -> Any:
        """Its value, within cluster.wait_timeout_s, or a TimeoutError naming `what`."""

    def ready(self, pending: Pending, timeout_s: float) -> bool: ...

    def result(self, pending: Pending) -> Any:
        """Its value; TrainerRestarted if the trainer died meanwhile."""

    def ready_groups(self) -> int:
        """Complete groups in the experience buffer."""

    def untrained_groups(self) -> int:
        """Groups leased or complete that the trainer has not taken."""

    def hand_out_resumed(self, started: bool | None = None) -> None:
        """A resumed job's in-flight trajectories, dealt out to the live rollouts."""

    def finish(self) -> dict[str, Any]:
        """Stop every loop; where every leased prompt group ended up."""

    # --- what the follower observes
    def trainer_rows(self, since: int) -> list[dict[str, Any]]:
        """The trainer's metrics rows from index `since`; TrainerRestarted while it restarts."""

    def snapshots(self) -> dict[str, RolloutSnapshot]: ...

    def manager_stats(self) -> dict[str, Any]: ...

    def request_eval(self, job: EvalJob) -> str | None:
        """A held-out evaluation by the next live rollout in turn: its id (None: none alive)."""

    def take_records(self, close: bool = False) -> dict[str, dict[str, Any]]:
        """Per rollout, since the last call: {"evals", "spans", "env_latency_s", "turns"}."""

    def idle(self, seconds: float) -> None:
        """Let the rollouts run for `seconds` (one process: steps them)."""

    # --- operators (`laminar scale`, `laminar status`, RUN_DIR/processes.json)
    def process_ids(self, manager: dict[str, Any]) -> dict[str, Any]: ...

    def rollout_nodes(self) -> dict[str, str]: ...

    def pool_depths(self) -> dict[str, int]: ...

    def scale_up(self, n: int, new_node: bool = False) -> list[str]: ...

    def retire_worker(self, wid: str) -> int: ...
