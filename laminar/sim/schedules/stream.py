"""stream (StreamRL / AsyncFlow stream generation, staleness <= 1): like one_step, but the
trainer takes mini-batches of complete groups as they finish instead of the whole batch.
Rollouts still meet at one global barrier per iteration to receive the new version.

    rollouts: gen(j) with v_{j-1} ............ [barrier: gen(j) done, v_j ready] sync, gen(j+1)
    trainer:  ... update j-1 | mb1(j) mb2(j) ...... mb_last(j) -> v_{j+1}
"""

from __future__ import annotations

from laminar.sim.core import Ledger, Setup, SimResult, finish_result
from laminar.sim.schedules.common import generate, minibatches_by_completion, train_pipeline


def run(setup: Setup, warmup: int, measure: int) -> SimResult:
    replicas, work, ledger = setup.make_replicas(), setup.make_workload(), Ledger()
    batch = generate(replicas, work.groups(setup.prompts, 0.0), 0.0, 0)
    controller_free = trainer_free = 0.0
    for j in range(warmup + measure):
        # Rollouts wait for the whole batch and for v_j (update j-1) before generating j+1.
        start = max(max(tr.t_finished for tr in batch), trainer_free) + setup.sync_s
        nxt = generate(replicas, work.groups(setup.prompts, start), start, j)
        parts = minibatches_by_completion(batch, setup.minibatches)  # as groups complete
        controller_free, trainer_free, busy = train_pipeline(
            setup, parts, controller_free, trainer_free)
        ledger.consume(trainer_free, batch, j, busy)
        batch = nxt
    return finish_result(setup, ledger, replicas, batch, warmup, trainer_free)
