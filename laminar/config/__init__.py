"""One typed config tree, loaded from YAML with dotted command-line overrides.

    cfg = load_config("examples/reverse.yaml", ["trainer.lr=1e-4", "rollout.num_workers=4"])

Rooms: base.py (the `Section` base, the mode and device vocabularies, `ConfigError`,
`RunStopped`), schema.py (the root `Config` and its cross-section rules; `model`, `metrics`,
`sandbox`), tasks.py (the `task` section beside its rules), rollout.py (`rollout`,
`rollout.engine`), trainer.py (`trainer`, `sft`), cluster.py (`cluster`, `manager`, `relay`),
bench.py (`bench`: benchmark-only emulations), load.py (YAML + overrides, error messages,
retired and renamed keys), explain.py (`laminar config --explain KEY`). Every field has a
description. The package imports nothing else from laminar; every name is importable from here.
"""

from laminar.config.base import (DEVICES, GLOBAL_BATCH_MODES, MODES, PRESET_POSITIONS, ConfigError,
                                 Device, Mode, RunStopped, Section)
from laminar.config.bench import BenchConfig, EnvLatencyConfig
from laminar.config.cluster import ClusterConfig, ManagerConfig, RelayConfig
from laminar.config.load import (RENAMED, RETIRED, TARGET_KEYS, apply_override,
                                 format_validation_error, load_config)
from laminar.config.rollout import EngineConfig, RolloutConfig
from laminar.config.schema import Config, MetricsConfig, ModelConfig, SandboxConfig
from laminar.config.tasks import (CalcTaskConfig, DatasetConfig, HumanEvalTaskConfig,
                                  ReasoningGymDatasetConfig, ReasoningGymTaskConfig,
                                  ReverseTaskConfig, TaskConfig)
from laminar.config.trainer import (CORRECTION_PARAMS, CorrectionConfig, LoraConfig, SFTConfig,
                                     TrainerConfig)

__all__ = [
    "CORRECTION_PARAMS", "DEVICES", "GLOBAL_BATCH_MODES", "MODES", "PRESET_POSITIONS", "RENAMED", "RETIRED",
    "TARGET_KEYS", "BenchConfig", "CalcTaskConfig", "ClusterConfig", "Config", "ConfigError",
    "CorrectionConfig",
    "DatasetConfig", "Device", "EngineConfig", "EnvLatencyConfig", "HumanEvalTaskConfig",
    "LoraConfig", "ManagerConfig", "MetricsConfig", "Mode", "ModelConfig",
    "ReasoningGymDatasetConfig", "ReasoningGymTaskConfig", "RelayConfig", "ReverseTaskConfig",
    "RolloutConfig", "RunStopped", "SFTConfig", "SandboxConfig", "Section", "TaskConfig",
    "TrainerConfig", "apply_override", "format_validation_error", "load_config",
]
