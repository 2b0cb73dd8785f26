"""Typed recipes: TOML files in ``recipes/`` validated into one frozen config per component."""

from osvl.config.loader import apply_overrides, build, load_recipe, parse_override, recipe_to_dict, resolve_recipe_path
from osvl.config.recipe import (
    CheckpointConfig,
    DataConfig,
    GRPOConfig,
    JobConfig,
    JudgesConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    Recipe,
    RolloutConfig,
    SchedulerConfig,
    SFTConfig,
    ToolsConfig,
    ValidationConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "GRPOConfig",
    "JobConfig",
    "JudgesConfig",
    "MetricsConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimizerConfig",
    "Recipe",
    "RolloutConfig",
    "SFTConfig",
    "SchedulerConfig",
    "ToolsConfig",
    "ValidationConfig",
    "apply_overrides",
    "build",
    "load_recipe",
    "parse_override",
    "recipe_to_dict",
    "resolve_recipe_path",
]
