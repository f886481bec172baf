"""Where users import a run's configuration from: ``rlrunbook.rl.config.TrainConfig`` and its sections.

The configuration lives in :mod:`rlrunbook.rl.setup.config`; this module hands its public names on.
"""

from rlrunbook.rl.setup.config import (
    CONFIG_VERSION,
    BackendSettings,
    CheckpointSettings,
    DataSettings,
    DynamicSamplingSettings,
    LossSettings,
    MismatchSettings,
    RewardSettings,
    TrainConfig,
    ValidationSettings,
    validate,
)

__all__ = ["CONFIG_VERSION", "BackendSettings", "CheckpointSettings", "DataSettings", "DynamicSamplingSettings",
           "LossSettings", "MismatchSettings", "RewardSettings", "TrainConfig", "ValidationSettings", "validate"]
