"""What the driver observes while a schedule runs: the pieces its `Follower`
(laminar/modes/driver.py) composes around its run loop.

- `activity.py`: what the rollouts did between two trainer rows (generation tokens/s, idle
  fraction, KV use, pulls, environment latencies, turns) and the live view's fleet lines.
- `evals.py`: the held-out evaluation schedule (at the start, every `trainer.eval_every`
  versions or `trainer.eval_every_s` seconds, at the end; moved off a rollout that left).
- `events.py`: `event` rows from what changed in the manager's stats (repack, failure, join,
  leave, chain).
- `operators.py`: RUN_DIR/processes.json, faults-JOB.json and status.json, and the answers to
  `laminar scale` requests, over the control channel of `control.py`.
"""
