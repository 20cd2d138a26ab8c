"""The paper's numbers that the simulator is built from or checked against (read-only data).

Every value is from `shared/reference/paper-details.md` (digitised figures are ±1%):
- `ALLOCATIONS`: Table 2, GPUs per system as (total, trainer, rollout); verl is colocated.
- `ROLLOUT_TP`: App. A.2 tensor parallelism of a rollout replica.
- `FIG11`: end-to-end throughput (tokens/s) per model, scale and system — the fidelity target.
- `FIG17_QUANTILES`: response-length CDF points per model (p50, p90, p99, max).
- `FIG4_DECODE_MS`: one decode step (ms) at sequence length 4096, by (model, TP) and batch size.
- `FIG9`: landmarks of one 32B TP4 replica generating 512 trajectories (the idleness metric).
- `FIG14`: weight-sync waiting (s) vs rollout GPUs; `FIG18`: relay broadcast (s) vs machines.
- `BATCH`: §8.1 / Table 3 batch settings.

Mode names are the project's (DESIGN.md §6): sync = verl, one_step, stream = stream
generation, partial = AReaL, laminar.
"""

from __future__ import annotations

from laminar.types import MODES

BASELINES = tuple(m for m in MODES if m != "laminar")
PAPER_NAMES = {"laminar": "Laminar", "sync": "verl", "one_step": "One-step",
               "stream": "StreamGen", "partial": "AReaL"}
MODELS = ("7b", "32b", "72b")

# Table 2: per model, the five scales as (total, trainer, rollout). verl uses every GPU for both.
_ONE_STEP = {  # One-step = StreamGen
    "7b": [(16, 8, 8), (32, 8, 24), (64, 16, 48), (128, 32, 96), (256, 40, 216)],
    "32b": [(32, 16, 16), (64, 32, 32), (128, 48, 80), (256, 64, 192), (512, 80, 432)],
    "72b": [(64, 32, 32), (128, 64, 64), (256, 96, 160), (512, 192, 320), (1024, 256, 768)],
}
_AREAL = {
    "7b": [(16, 8, 8), (32, 16, 16), (64, 32, 32), (128, 64, 64), (256, 128, 128)],
    "32b": [(32, 16, 16), (64, 32, 32), (128, 64, 64), (256, 128, 128), (512, 256, 256)],
    "72b": [(64, 32, 32), (128, 64, 64), (256, 128, 128), (512, 320, 192), (1024, 640, 384)],
}
_LAMINAR = {
    "7b": [(16, 8, 8), (32, 24, 8), (64, 40, 24), (128, 80, 48), (256, 192, 64)],
    "32b": [(32, 16, 16), (64, 32, 32), (128, 64, 64), (256, 128, 128), (512, 256, 256)],
    "72b": [(64, 32, 32), (128, 64, 64), (256, 128, 128), (512, 320, 192), (1024, 768, 256)],
}
_SYNC = {m: [(t, t, t) for t, _, _ in rows] for m, rows in _ONE_STEP.items()}
ALLOCATIONS: dict[str, dict[str, list[tuple[int, int, int]]]] = {
    "sync": _SYNC, "one_step": _ONE_STEP, "stream": _ONE_STEP, "partial": _AREAL,
    "laminar": _LAMINAR,
}
SCALES = {m: [t for t, _, _ in rows] for m, rows in _ONE_STEP.items()}

# App. A.2: rollout TP. 7B is TP1 in AReaL and Laminar, TP2 elsewhere.
ROLLOUT_TP = {"7b": 2, "32b": 4, "72b": 8}
ROLLOUT_TP_7B_SINGLE = ("partial", "laminar")
# App. A.2: AReaL trains with Megatron-LM at these (TP, PP); the others use FSDP + Ulysses SP.
AREAL_TRAIN_TP_PP = {"7b": (2, 1), "32b": (4, 2), "72b": (4, 4)}

# Fig. 11: tokens/s by model, total GPUs and mode.
FIG11: dict[str, dict[int, dict[str, float]]] = {
    "7b": {
        16: dict(sync=27.8e3, one_step=28.3e3, stream=31.0e3, partial=28.8e3, laminar=34.8e3),
        32: dict(sync=37.1e3, one_step=45.1e3, stream=46.0e3, partial=54.9e3, laminar=66.6e3),
        64: dict(sync=45.4e3, one_step=61.1e3, stream=62.0e3, partial=81.5e3, laminar=137.1e3),
        128: dict(sync=46.4e3, one_step=62.5e3, stream=63.0e3, partial=115.2e3, laminar=208.6e3),
        256: dict(sync=47.3e3, one_step=63.5e3, stream=64.0e3, partial=158.8e3, laminar=260.0e3),
    },
    "32b": {
        32: dict(sync=17.7e3, one_step=15.5e3, stream=18.0e3, partial=20.4e3, laminar=21.0e3),
        64: dict(sync=30.0e3, one_step=27.5e3, stream=30.0e3, partial=39.5e3, laminar=39.9e3),
        128: dict(sync=42.4e3, one_step=53.0e3, stream=53.0e3, partial=58.2e3, laminar=69.0e3),
        256: dict(sync=49.7e3, one_step=63.8e3, stream=64.0e3, partial=84.4e3, laminar=122.7e3),
        512: dict(sync=50.8e3, one_step=63.8e3, stream=65.0e3, partial=128.6e3, laminar=229.9e3),
    },
    "72b": {
        64: dict(sync=19.1e3, one_step=19.3e3, stream=19.5e3, partial=18.8e3, laminar=20.1e3),
        128: dict(sync=25.8e3, one_step=31.2e3, stream=32.0e3, partial=33.0e3, laminar=38.9e3),
        256: dict(sync=34.7e3, one_step=42.1e3, stream=42.9e3, partial=42.1e3, laminar=54.1e3),
        512: dict(sync=34.1e3, one_step=57.6e3, stream=58.0e3, partial=59.8e3, laminar=87.8e3),
        1024: dict(sync=33.0e3, one_step=58.1e3, stream=59.0e3, partial=82.4e3, laminar=149.1e3),
    },
}
HEADLINE = ("7b", 256, "sync", 5.48)  # the abstract's "up to 5.48x": 7B @ 256 GPUs over verl

# Fig. 17 (App. A.1): response-length CDF points in tokens.
FIG17_QUANTILES: dict[str, dict[float, float]] = {
    "7b": {0.5: 6.2e3, 0.9: 9.7e3, 0.99: 14.1e3, 1.0: 16.4e3},
    "32b": {0.5: 2.8e3, 0.9: 6.0e3, 0.99: 10.6e3, 1.0: 16.4e3},
    "72b": {0.5: 0.9e3, 0.9: 1.7e3, 0.99: 2.8e3, 1.0: 12.3e3},
}

# Fig. 4: decode-step latency (ms) at sequence length 4096, keyed (model, TP) -> {batch: ms}.
FIG4_DECODE_MS: dict[tuple[str, int], dict[int, float]] = {
    ("7b", 1): {1: 6.9, 32: 9.5, 64: 12.6, 128: 18.0, 256: 29.6},
    ("32b", 4): {1: 10.6, 32: 14.9, 64: 18.2, 128: 25.8, 256: 37.2},
    ("32b", 2): {1: 15.8, 64: 27.7},
}
FIG4_SEQ_LEN = 4096

# Fig. 9: one 32B TP4 replica, a batch of 512 trajectories (seconds from the batch start).
FIG9 = dict(model="32b", tp=4, batch=512, kv_full_s=160.0, queue_empty_s=325.0,
            remaining_at_405s=20, batch_done_s=675.0)

# Fig. 14: rollout waiting time for new weights (s) at 32 and 512 rollout GPUs.
FIG14 = {
    "32b": dict(global_sync=(0.81, 0.98), laminar_mean=(0.69, 0.73), laminar_best=0.57,
                actor_stall=0.64),
    "72b": dict(global_sync=(1.87, 2.45), laminar_mean=(1.37, 1.55), laminar_best=1.30,
                actor_stall=1.40),
}
FIG14_ROLLOUT_GPUS = (32, 512)

# Fig. 18: relay broadcast latency (s) by number of machines (8 GPUs each).
FIG18_MACHINES = (4, 8, 16, 32, 64, 128)
FIG18 = {"32b": (0.42, 0.49, 0.55, 0.61, 0.67, 0.73),
         "72b": (0.94, 1.10, 1.24, 1.37, 1.50, 1.60)}

# §8.1 and Table 3.
BATCH = dict(prompts=512, samples=16, max_response=16384, max_prompt=2048,
             minibatches_sync=16, minibatches_async=4, max_concurrency=1024)
REPACK_OVERHEAD_S = 0.69  # Table 1: repack overhead per repack
REPACK_CHECK_S = 5.0  # §5.1: periodic check
GPUS_PER_MACHINE = 8


def allocation(mode: str, model: str, gpus: int) -> tuple[int, int, int]:
    """(total, trainer, rollout) GPUs of Table 2; ValueError names what is allowed."""
    if model not in ALLOCATIONS[mode]:
        raise ValueError(f"unknown model {model!r}; allowed: {', '.join(MODELS)}")
    for row in ALLOCATIONS[mode][model]:
        if row[0] == gpus:
            return row
    allowed = ", ".join(str(s) for s in SCALES[model])
    raise ValueError(f"--gpus {gpus} is not a {model} scale of the paper's Table 2; "
                     f"allowed for {model}: {allowed}")


def rollout_tp(mode: str, model: str) -> int:
    if model == "7b" and mode in ROLLOUT_TP_7B_SINGLE:
        return 1
    return ROLLOUT_TP[model]
