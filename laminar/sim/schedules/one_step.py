"""one_step: batch j+1 is generated with version j while the trainer trains on batch j
(one-step off-policy, staleness 1); one global barrier and weight sync per iteration.

    iteration j:  rollouts: gen(j+1) with v_j  ||  controller + trainer: batch j -> v_{j+1}
                  barrier when both are done -> sync v_{j+1} to every rollout
"""

from __future__ import annotations

from laminar.sim.core import Ledger, Setup, SimResult, finish_result
from laminar.sim.schedules.common import generate, minibatches_by_completion, train_pipeline


def run(setup: Setup, warmup: int, measure: int) -> SimResult:
    replicas, work, ledger = setup.make_replicas(), setup.make_workload(), Ledger()
    batch = generate(replicas, work.groups(setup.prompts, 0.0), 0.0, 0)
    controller_free = trainer_free = 0.0
    for j in range(warmup + measure):
        gen_end = max(tr.t_finished for tr in batch)
        # Barrier: batch j fully generated and update j-1 done; then everyone syncs v_j.
        start = max(gen_end, trainer_free) + setup.sync_s
        nxt = generate(replicas, work.groups(setup.prompts, start), start, j)
        # The controller scores trajectories as they complete (while batch j+1 waits at
        # the barrier, as in stream); the trainer starts once batch j is complete.
        parts = minibatches_by_completion(batch, setup.minibatches)
        controller_free, trainer_free, busy = train_pipeline(
            setup, parts, controller_free, start, train_after=gen_end)
        ledger.consume(trainer_free, batch, j, busy)
        batch = nxt
    return finish_result(setup, ledger, replicas, batch, warmup, trainer_free)
