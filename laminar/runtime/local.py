"""The runtime in one process (`cluster.backend: local`): no Ray, no relays, no threads.

The same `RolloutLoop`s (with the in-process doors of laminar/rollout/io.py), the same
`TrainerService` and the same pools as on a cluster; weights go from the trainer to the
rollouts through a `WeightBoard`. Every driver call runs to completion before it returns:
`generate` steps the loops until the batch is in the buffer, `sync_weights` until every loop
holds the version. So a schedule whose waits come one after another (sync) runs unchanged;
one that needs rollouts and trainer to run at once needs `cluster.backend: ray`.

Held-out evaluations run in the loops' evaluators as on a cluster; they advance whenever the
loops are stepped (during generation, a sync, or `idle`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from laminar.config import Config, ConfigError
from laminar.envs.openai_server import serve_rollout
from laminar.models import load_pretrained
from laminar.models.tokenizer import encode_prompt
from laminar.pools.build import POOLS, pool_specs
from laminar.pools.experience import ExperienceBuffer
from laminar.pools.prompts import PromptPool
from laminar.pools.resume import RESUMED, deal_resumed, prepare_pools
from laminar.rollout.build import build_rollout
from laminar.rollout.evals import EvalJob
from laminar.rollout.io import (BoardWeights, LocalBuffer, LocalPartials, LocalPrompts, RolloutIO,
                                WeightBoard)
from laminar.rollout.loop import RolloutLoop
from laminar.rollout.policy import Policy
from laminar.runtime.api import ONE_PROCESS_SCALE, TrainerCall
from laminar.tasks import build_task
from laminar.trainer.service import TrainerService, newest_checkpoint
from laminar.types import RolloutSnapshot, Trajectory


class LocalTrainerData:
    def __init__(self, prompts: PromptPool, buffer: ExperienceBuffer) -> None:
        self.prompts, self.buffer = prompts, buffer

    def sample(self, num_groups: int, trainer_version: int) -> list[list[Trajectory]] | None:
        return self.buffer.sample(num_groups, trainer_version)

    def consumed(self, num_groups: int) -> None:
        self.prompts.mark_consumed(num_groups)

    def ack(self, version: int) -> None:
        self.buffer.ack(version)

    def rewind(self, version: int | None) -> int:
        return self.buffer.rewind(version)

    def counts(self) -> dict[str, int]:
        return self.buffer.counts()

    def prompt_state(self) -> dict[str, Any]:
        return self.prompts.state_dict()

    def load_prompt_state(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)


class BoardPush:
    def __init__(self, board: WeightBoard) -> None:
        self.board = board

    def push(self, named: dict[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        self.board.publish(named, version)
        return time.perf_counter() - t0


class Done:
    """A driver call that has already run."""

    def __init__(self, value: Any) -> None:
        self.value = value


class LocalRuntime:
    one_process = True  # no processes to name, no nodes, no elasticity
    job = None  # no job id: nothing is named across processes
    resumed = None  # a resumed job's reconciliation is printed as the pools load

    def __init__(self, cfg: Config, model_dir: str, start_version: int, policy: Policy) -> None:
        if cfg.trainer.world_size > 1:
            raise ConfigError(f"trainer.world_size={cfg.trainer.world_size}: cluster.backend=local "
                              "runs one trainer in this process; set cluster.backend=ray for "
                              "several ranks, or trainer.world_size=1")
        self.cfg, self.model_dir, self.start_version, self.policy = cfg, model_dir, start_version, policy

    def __enter__(self) -> "LocalRuntime":
        cfg = self.cfg
        self.task = build_task(cfg.task, cfg.sandbox)
        if self.task.load_report:
            print(self.task.load_report.summary())
        if cfg.rollout.openai_server:  # task.agent's endpoint: one for the rollouts of this process
            serve_rollout(cfg, "local")
        model, self.tokenizer = load_pretrained(self.model_dir, cfg.model.attn_implementation)
        db, summary = prepare_pools(cfg, self.start_version if newest_checkpoint(cfg.resolved_run_dir)
                                    and cfg.resume else None, self.start_version,
                                    self.policy.mixes_versions)
        if summary is not None:
            print(f"resume: {summary.line()}", flush=True)
        pools = pool_specs(cfg, self.task.train, partial(encode_prompt, self.tokenizer),
                           self.policy.max_outstanding, db)
        self.prompts, self.partials, self.buffer = (pools[k].build() for k in POOLS)
        self.board = WeightBoard()
        self.trainer = TrainerService(cfg, self.model_dir, LocalTrainerData(self.prompts, self.buffer),
                                      BoardPush(self.board))
        self.loops = [self._loop(f"rollout{i}", model if i == 0 else None)
                      for i in range(cfg.rollout.num_workers)]
        if cfg.resume and not self.policy.defers_resumed:
            self.hand_out_resumed()
        self.eval_turn = -1
        print(f"{cfg.mode} mode in one process: {cfg.trainer.total_steps} steps x "
              f"{cfg.trainer.prompts_per_step} prompts x {cfg.rollout.group_size} samples")
        self.started_at = time.time()  # the driver's rows count from here
        return self

    def _loop(self, rollout_id: str, model: torch.nn.Module | None) -> RolloutLoop:
        io = RolloutIO(LocalPrompts(self.prompts), LocalPartials(self.partials),
                       LocalBuffer(self.buffer), BoardWeights(self.board))
        return build_rollout(self.cfg, rollout_id, self.model_dir, self.tokenizer, self.task, io,
                             self.policy, self.start_version, model)  # model None: read again

    def __exit__(self, *exc: object) -> None:
        for loop in self.loops:
            loop.finisher.close()
            if loop.evaluator is not None:
                loop.evaluator.close()
            loop.engine.close()

    # ------------------------------------------------------------------------- the driver API

    def _pump(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        while not done():
            if not any([loop.step() for loop in self.loops]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not finish within cluster.wait_timeout_s="
                                       f"{self.cfg.cluster.wait_timeout_s:.0f}s")
                time.sleep(0.001)

    def generate(self, num_groups: int) -> Done:
        n = len(self.loops)
        for i, loop in enumerate(self.loops):
            loop.request_groups(num_groups // n + (i < num_groups % n))
        self._pump(lambda: all(loop.batch_done for loop in self.loops), "generation")
        return Done(num_groups)

    def hand_out_resumed(self, started: bool | None = None) -> None:
        """The killed job's in-flight trajectories, dealt out evenly (see ClusterRuntime)."""
        loops = {loop.id: loop for loop in self.loops}
        for wid, mine in deal_resumed(self.partials.owned_by(RESUMED), list(loops), started).items():
            if not loops[wid].adopt(mine):
                raise RuntimeError(f"{wid} refused the resumed trajectories (version mismatch); "
                                   "this is a bug: please report it")
            self.partials.reassign([m.request.request_id for m in mine], wid, [m.request for m in mine])

    def ready_groups(self) -> int:
        return self.buffer.num_ready()

    def untrained_groups(self) -> int:
        """Groups leased or complete that the trainer has not taken (see ClusterRuntime)."""
        return self.prompts.untrained()

    def sync_weights(self, version: int) -> None:
        for loop in self.loops:
            loop.request_version(version)
        self._pump(lambda: all(loop.holds_version(version) for loop in self.loops),
                   f"the weight sync to version {version}")

    def train(self, method: TrainerCall) -> Done:
        if method == "run":
            return Done(self.trainer.run(self.cfg.trainer.total_steps))
        return Done(getattr(self.trainer, method)())

    def wait(self, pending: Done, what: str) -> Any:
        return pending.value

    def ready(self, pending: Done, timeout_s: float) -> bool:
        return True

    def result(self, pending: Done) -> Any:
        return pending.value

    def trainer_rows(self, since: int) -> list[dict[str, Any]]:
        return self.trainer.metrics_since(since)

    def snapshots(self) -> dict[str, RolloutSnapshot]:
        return {loop.id: loop.snapshot() for loop in self.loops}

    def request_eval(self, job: EvalJob) -> str | None:
        self.eval_turn += 1
        loop = self.loops[self.eval_turn % len(self.loops)]
        loop.request_eval(job)
        return loop.id

    def take_records(self, close: bool = False) -> dict[str, dict[str, Any]]:
        return {loop.id: loop.take_records(close) for loop in self.loops}

    def idle(self, seconds: float) -> None:
        """Step the loops for up to `seconds` (nothing else runs them between driver calls)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not any([loop.step() for loop in self.loops]):
                time.sleep(0.001)

    def manager_stats(self) -> dict[str, Any]:
        return {"repacks": 0, "moved_trajectories": 0, "dead": [], "chain": [],
                "workers": [loop.id for loop in self.loops]}

    def finish(self) -> dict[str, Any]:
        for loop in self.loops:
            loop.settle(timeout_s=self.cfg.cluster.wait_timeout_s)
        for pool in (self.prompts, self.partials, self.buffer):
            pool.flush()
        return {"prompts": self.prompts.accounting(), "buffer": self.buffer.counts(),
                "manager": self.manager_stats()}

    # ------------------------------------------------------------------------- operators

    def process_ids(self, manager: dict[str, Any]) -> dict[str, Any]:
        """Everything is this process."""
        return {"job": None, "driver": os.getpid(), "trainer": os.getpid(),
                "rollouts": {loop.id: os.getpid() for loop in self.loops}, "relays": {}, "chain": []}

    def rollout_nodes(self) -> dict[str, str]:
        return {}  # one machine, no Ray nodes

    def pool_depths(self) -> dict[str, int]:
        acct = self.prompts.accounting()
        return {"groups_leased": acct["leased"], "groups_returned": acct["returned"],
                "groups_trained": acct["consumed"], "trajectories_in_flight": self.partials.size(),
                "groups_ready": self.buffer.counts()["ready_groups"]}

    def scale_up(self, n: int, new_node: bool = False) -> list[str]:
        raise RuntimeError(ONE_PROCESS_SCALE)

    def retire_worker(self, wid: str) -> int:
        raise RuntimeError(ONE_PROCESS_SCALE)
