"""sync (verl): all GPUs generate one global batch with version v, then all GPUs train on it,
then every rollout receives v+1 (global sync). Colocated: rollout GPUs = trainer GPUs.

    gen(v) -> [barrier] -> controller + train(v) on every GPU -> sync -> gen(v+1) ...
"""

from __future__ import annotations

from laminar.sim.core import Ledger, Setup, SimResult, finish_result
from laminar.sim.schedules.common import generate, minibatches_by_completion, train_pipeline


def run(setup: Setup, warmup: int, measure: int) -> SimResult:
    replicas, work, ledger = setup.make_replicas(), setup.make_workload(), Ledger()
    t = 0.0
    for version in range(warmup + measure):
        batch = generate(replicas, work.groups(setup.prompts, t), t, version)
        gen_end = max(tr.t_finished for tr in batch)  # the slowest trajectory gates training
        parts = [(gen_end, p) for _, p in minibatches_by_completion(batch, setup.minibatches)]
        _, t, busy = train_pipeline(setup, parts, gen_end, gen_end, setup.gpus)
        ledger.consume(t, batch, version, busy)
        t += setup.sync_s
    return finish_result(setup, ledger, replicas, [], warmup, t)
