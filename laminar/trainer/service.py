"""The trainer as a service: sample the experience buffer, train, publish the weights, go on.

    service = TrainerService(cfg, model_dir, data, weights)     # no Ray: two small doors
    service.train_once()        # one global batch: wait for it, train, publish, log a row

It never waits for rollouts, only for data (④, through `TrainerData`): `train_once` takes one
global batch of complete groups (FIFO), records each sample's staleness, runs the GRPO update,
publishes the new version (⑤, through `WeightSink`: the master relay, returning as soon as it
holds the version) and logs one metrics row; `train_streaming` does the same a mini-batch at a
time, each as soon as its groups are complete. The free-running schedules call `train_next`
(= `train_streaming`; laminar through `run`, which repeats it); the global-batch schedules call
`train_once` / `train_streaming` themselves, which is where their waits are.

The Ray actor (laminar/trainer/actor.py) gives it the pool actors and the relay pusher; the
one-process runtime gives it the pools themselves and a `WeightBoard`. A restarted trainer
(`restarted=True`) recovers from the newest checkpoint of the run (`_recover`). With
trainer.world_size > 1 this is rank 0 of the trainer group: the update, the checkpoint and the
push run on every rank (laminar/trainer/trainer.py drives them); the data, the metrics and
the audit trail stay here.

Throughput is the paper's: (prompt + response tokens of the global batch) / (time between two
consecutive updates).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from laminar.config import Config, RunStopped
from laminar.devices import trainer_loan
from laminar.metrics import set_aside, summarize
from laminar.models import load_pretrained
from laminar.relay.version import VersionHeader
from laminar.trainer.ranks import Ranks
from laminar.trainer.trainer import NonFiniteTraining, Trainer
from laminar.types import Trajectory

# The trainer's wait for data asks the buffer again after a nap that grows from the first to
# the second number: an idle trainer asked 200 times a second before, a Ray call each, whose CPU
# on both sides (trainer and buffer) came out of the cores the rollouts were generating on.
WAIT_NAP_S = (0.005, 0.025)


def drop_torn_last_line(path: Path, block: int = 1 << 16) -> None:
    """Cut a JSONL file back to its last complete line (a process killed mid-append). Reads
    only the file's tail."""
    if not path.exists():
        return
    with path.open("rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            if pos == end and chunk.endswith(b"\n"):
                return  # complete
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)  # not one complete line


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest complete checkpoint (RUN_DIR/checkpoints/step_NNNNNN; a `.tmp` one was
    cut short by a kill)."""
    ckpts = sorted(p for p in (run_dir / "checkpoints").glob("step_*")
                   if not p.name.endswith(".tmp") and (p / "trainer_state.json").is_file())
    return ckpts[-1] if ckpts else None


class TrainerData(Protocol):
    """What the trainer needs of the pools: complete groups, and the prompt pool's position."""

    def sample(self, num_groups: int, trainer_version: int) -> list[list[Trajectory]] | None: ...

    def consumed(self, num_groups: int) -> None: ...  # the prompt pool's admission count

    def ack(self, version: int) -> None: ...  # the checkpoint at `version` holds what was taken before

    def rewind(self, version: int | None) -> int: ...  # a restart from that checkpoint: the rest goes back

    def counts(self) -> dict[str, int]: ...

    def prompt_state(self) -> dict[str, Any]: ...

    def load_prompt_state(self, state: dict[str, Any]) -> None: ...


class WeightSink(Protocol):
    def push(self, named: dict[str, torch.Tensor], version: int) -> float:
        """Publish `version`; returns the trainer's stall in seconds."""

    def push_parts(self, header: VersionHeader, fill: Callable[[memoryview, Path], None]) -> float:
        """Publish `header.version`, whose bytes `fill(data, path)` writes (the ranks of a
        sharded trainer, laminar/trainer/shards.py); returns the stall in seconds."""


class TrainerService:
    def __init__(self, cfg: Config, model_dir: str, data: TrainerData, weights: WeightSink,
                 restarted: bool = False, ranks: Ranks | None = None) -> None:
        """`ranks`: this is rank 0 of a trainer group (trainer.world_size > 1) whose other
        ranks follow it (laminar/trainer/ranks.py)."""
        torch.set_num_threads(cfg.trainer.threads)
        torch.manual_seed(cfg.trainer.seed)
        self.cfg = cfg
        model, self.tokenizer = load_pretrained(model_dir, cfg.model.attn_implementation)
        self.trainer = Trainer(model, cfg.trainer, self.tokenizer.pad_token_id,
                               cfg.rollout.temperature, ranks)
        self.data, self.weights = data, weights
        self.skipped_versions = 0  # version numbers a restart skipped: version - steps
        if cfg.trainer.from_checkpoint:  # a new run from another run's checkpoint
            extra = self.trainer.load_checkpoint(cfg.trainer.from_checkpoint)
            self.skipped_versions = self.trainer.version - extra.get("steps", self.trainer.version)
            if not (restarted or cfg.resume):  # a live or restored pool knows its own position
                self.data.load_prompt_state(extra["prompts"])
        self.history: list[dict[str, Any]] = []
        if restarted or cfg.resume:
            self._recover("trainer_restart" if restarted else "resume")
        elif not cfg.trainer.from_checkpoint:
            set_aside(cfg.resolved_run_dir / "trajectories.jsonl")
        self.last_update: float | None = None
        self.idle_s = 0.0
        self.spans: list[list[Any]] = []  # [what, start, end] in Unix seconds, since the last row
        self.stop_event = threading.Event()
        self.loan = trainer_loan(cfg)  # cluster.cpu_affinity=lend: its cores, while it waits

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def steps(self) -> int:
        """Updates in this model's lineage (what trainer.total_steps counts): its version,
        less the numbers a restart skipped (`_recover`)."""
        return self.trainer.version - self.skipped_versions

    def publish(self) -> float:
        """Publish the current weights; returns the stall in seconds. The version number is
        recorded as taken before the push: a trainer killed after the master relay completed
        the version, but before recording it, numbered on from the one before after its restart
        and pushed other weights under a number the relays held already (seen under load: the
        rollouts then never got a newer version)."""
        tmp = self._state_file.with_suffix(".tmp")  # atomic: a kill never leaves half a file
        tmp.write_text(json.dumps({"published": self.trainer.version}))
        os.replace(tmp, self._state_file)
        return self.trainer.push(self.weights, self.trainer.version, self.cfg.relay.chunk_bytes)

    @property
    def _state_file(self) -> Path:
        return self.cfg.resolved_run_dir / "trainer_published.json"

    def _recover(self, event: str) -> None:
        """This actor was restarted after a crash (`trainer_restart`), or the whole job was
        (`resume`): reload the newest checkpoint of the run, give back to the buffer what was
        taken since (`rewind`: after a whole-job resume the pools were reconciled already, so
        nothing is left to give back), and go on numbering after the newest version already
        published (rollouts and relays only take newer ones). Marks the audit trail, which the
        exactly-once check at the end of the run reads."""
        ckpt = newest_checkpoint(self.cfg.resolved_run_dir)
        if ckpt is not None:
            extra = self.trainer.load_checkpoint(ckpt)
            self.skipped_versions = self.trainer.version - extra.get("steps", self.trainer.version)
        requeued = self.data.rewind(self.trainer.version if ckpt is not None else None)
        self.data.consumed(-requeued)
        resumed_at = self.trainer.version
        if self._state_file.exists():  # number on after the newest version already published
            published = json.loads(self._state_file.read_text())["published"]
            if published > self.trainer.version:  # its number names weights not at hand
                self.skipped_versions += published - self.trainer.version
                self.trainer.version = published
                self.trainer.weights_are_version = False
        audit = self.cfg.resolved_run_dir / "trajectories.jsonl"
        drop_torn_last_line(audit)  # the kill may have landed mid-append
        with audit.open("a") as f:
            f.write(json.dumps({"event": event, "checkpoint": str(ckpt) if ckpt else None,
                                "resumed_at": resumed_at, "continues_at": self.trainer.version,
                                "steps": self.steps, "requeued_groups": requeued}) + "\n")

    # ------------------------------------------------------------------------- training

    def wait_groups(self, num_groups: int, interruptible: bool = True) -> list[list[Trajectory]]:
        """Block until the buffer releases `num_groups` complete groups (the trainer's only wait).
        `stop()` ends the wait only when `interruptible`."""
        t0, wall = time.perf_counter(), time.time()
        deadline = time.monotonic() + self.cfg.cluster.wait_timeout_s
        nap = WAIT_NAP_S[0]
        while True:
            groups = self.data.sample(num_groups, self.trainer.version)
            if groups is not None:
                if self.loan is not None:
                    self.loan.lend(False)  # the rollouts leave its cores: it trains
                self.idle_s += time.perf_counter() - t0
                self._span("wait", wall)
                self.data.consumed(len(groups))
                return groups
            if interruptible and self.stop_event.is_set():
                raise InterruptedError("trainer stopped while waiting for data")
            if time.monotonic() > deadline:
                counts = self.data.counts()
                raise TimeoutError(
                    f"trainer waited {self.cfg.cluster.wait_timeout_s:.0f}s for {num_groups} "
                    f"complete groups; the experience buffer has {counts['ready_groups']} ready and "
                    f"{counts['filling_groups']} filling: the rollouts are stuck or too slow "
                    "(raise cluster.wait_timeout_s if they are just slow)")
            if self.loan is not None:
                # nothing to train: its cores are the rollouts' at once (lending only after
                # 20 ms of waiting lent them ~5% of the time; docs/performance.md)
                self.loan.lend(True)
            time.sleep(nap)  # each ask is a call to the buffer's process: back off
            nap = min(WAIT_NAP_S[1], nap * 1.5)

    def train_once(self) -> dict[str, Any]:
        """One global batch: wait for it, train on it, push the new version, log."""
        groups = self.wait_groups(self.cfg.trainer.prompts_per_step)
        with self._stop_on_divergence():
            return self._train_and_publish([t for g in groups for t in g])

    @contextlib.contextmanager
    def _stop_on_divergence(self) -> Any:
        """`trainer.max_nonfinite_steps` skipped updates in a row (NonFiniteTraining) stop the
        run with `RunStopped`: a checkpoint of the last good weights when no update of this
        global batch was applied (the weights then hold exactly the checkpointed lineage),
        else the newest checkpoint is named."""
        try:
            yield
        except NonFiniteTraining as e:
            applied = any("loss" in p for p in self.trainer._pending)
            if applied:
                newest = newest_checkpoint(self.cfg.resolved_run_dir)
                where = (f"the newest checkpoint is {newest}" if newest else "no checkpoint was "
                         "written yet") + (" (updates of this global batch were applied before "
                                           "the non-finite ones, so no new one is written)")
            else:
                where = f"the last good weights are checkpointed in {self.checkpoint()}"
            raise RunStopped(f"{e}. The run stopped; {where}. Go on with `laminar resume "
                             f"{self.cfg.resolved_run_dir} trainer.lr=...`") from None

    def train_next(self) -> dict[str, Any]:
        """The free-running schedules' update: each mini-batch trained as soon as its groups
        are complete (the version still changes once per global batch)."""
        return self.train_streaming()

    def train_streaming(self) -> dict[str, Any]:
        """Take each mini-batch as soon as its groups are complete, one optimizer update each,
        and bump the version at the end of the global batch (stream, laminar, partial). A stop
        lands between global batches: once a mini-batch has trained, the global batch finishes,
        so its groups are recorded as trained (an interrupted one left them consumed, in the
        weights and in no step: the exactly-once audit saw 2 groups too many)."""
        per_mini = -(-self.cfg.trainer.prompts_per_step // self.cfg.trainer.mini_batches)
        trajs: list[Trajectory] = []
        taken = 0
        while taken < self.cfg.trainer.prompts_per_step:
            n = min(per_mini, self.cfg.trainer.prompts_per_step - taken)
            trajs += [t for g in self.wait_groups(n, interruptible=taken == 0) for t in g]
            taken += n
            wall = time.time()
            with self._stop_on_divergence():
                self.trainer.train_minibatch(trajs[-n * self.cfg.rollout.group_size:])
            self._span("train", wall)
        return self._train_and_publish(trajs, already_trained=True)

    def run(self, total_steps: int) -> int:
        """laminar / partial: train until the model has `total_steps` updates or `stop()`;
        returns its updates (= its version unless a restart skipped version numbers)."""
        self.stop_event.clear()
        while self.steps < total_steps and not self.stop_event.is_set():
            try:
                self.train_next()
            except InterruptedError:
                break
        return self.steps

    def stop(self) -> None:
        self.stop_event.set()
        if self.loan is not None:
            self.loan.lend(False)

    def _train_and_publish(self, trajs: list[Trajectory], already_trained: bool = False) -> dict[str, Any]:
        t0, wall = time.perf_counter(), time.time()
        if already_trained:
            stats = self.trainer.finish_global_batch()
        else:
            stats = self.trainer.train_step(trajs)  # version += 1: one more step
        self._record(trajs)  # before the checkpoint that holds them (the exactly-once audit)
        every = self.cfg.trainer.checkpoint_every
        if (every and self.steps % every == 0) or self.steps == self.cfg.trainer.total_steps:
            self.checkpoint()
            self.data.ack(self.trainer.version)  # the checkpoint holds them: release the data
        self._span("train", wall)
        wall = time.time()
        stall = self.publish()
        self._span("push", wall)
        now = time.perf_counter()
        summary = summarize(trajs)
        interval = now - self.last_update if self.last_update is not None else None
        self.last_update = now
        row = {**summary, **stats, "version": self.trainer.version, "step": self.steps,
               "engine_backend": self.cfg.rollout.engine.backend, "push_stall_s": stall,
               "train_wall_s": now - t0, "update_interval_s": interval,
               "throughput_tokens_per_s": summary["batch_tokens"] / interval if interval else None,
               "trainer_idle_s": self.idle_s, "spans": self.spans, "published_at": time.time()}
        self.idle_s, self.spans = 0.0, []
        self.history.append(row)
        return row

    def _span(self, what: str, start: float, min_s: float = 0.005) -> None:
        end = time.time()
        if end - start >= min_s:
            self.spans.append([what, round(start, 4), round(end, 4)])

    def _record(self, trajs: list[Trajectory]) -> None:
        """Append what was trained to RUN_DIR/trajectories.jsonl: the audit trail of versions
        and staleness (one line per trajectory)."""
        path = self.cfg.resolved_run_dir / "trajectories.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for t in trajs:
                f.write(json.dumps({
                    "traj_id": t.traj_id, "group_id": t.group_id, "version": t.version,
                    "trained_at": self.trainer.version - 1, "staleness": t.staleness,
                    "token_versions": sorted(set(t.token_versions)) if t.token_versions else None,
                    "reward": round(t.reward, 4), "response_len": len(t.response_ids),
                    "failed": t.failed}) + "\n")

    def checkpoint(self) -> str:
        path = self.cfg.resolved_run_dir / "checkpoints" / f"step_{self.trainer.version:06d}"
        self.trainer.save_checkpoint(path, self.tokenizer, {"steps": self.steps,
                                                             "prompts": self.data.prompt_state()})
        return str(path)

    def metrics_since(self, index: int) -> list[dict[str, Any]]:
        return self.history[index:]
