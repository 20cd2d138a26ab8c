"""Discrete-event simulator of the five schedules at cluster scale (16-1024 GPUs).

Map:
- `paper`       the paper's numbers (Table 2, Fig. 4/9/11/14/17/18) — inputs and targets
- `costs`       physics of the testbed, fitted to the paper's measurements
- `calibration` the one place for every constant the paper does not give
- `workload`    prompt groups with Fig. 17 response lengths (optional tool/env latency)
- `replica`     one rollout replica: continuous batching, KV, preemption, closed-form steps
- `core`        a point's setup, the event clock, the trainer-side ledger, results
- `schedules/`  sync, one_step, stream, partial, laminar — one short file each
- `run`         one point / the Fig. 11 grid;  `cli` — `laminar simulate`
- `report`, `report_md`  tables, the Fig. 11-style chart, docs/simulator.md sections
- `fit`         how the calibration defaults were searched;  `local` — a measured machine
"""
