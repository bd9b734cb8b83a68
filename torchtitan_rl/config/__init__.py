"""JobConfig: the run's schema, TOML loading and the CLI. Code outside this package imports
the config's names from here; each section lives in the module of its concern.

    .venv/bin/python -m pytest tests/unit/test_config.py
"""

from torchtitan_rl.config.algorithm import AlgorithmSection, compares_group
from torchtitan_rl.config.distill import DistillSection
from torchtitan_rl.config.errors import ConfigError, read_json, text_fields
from torchtitan_rl.config.generator import (
    GeneratorParallelismSection,
    GeneratorSection,
    SamplingSection,
)
from torchtitan_rl.config.job import JobSection, ModelSection
from torchtitan_rl.config.job_config import JobConfig
from torchtitan_rl.config.manager import load_toml, parse_args, to_toml
from torchtitan_rl.config.outputs import CheckpointSection, MetricsSection
from torchtitan_rl.config.task import EvalSection, TaskSection
from torchtitan_rl.config.training import (
    LoRASection,
    ParallelismSection,
    SFTSection,
    TrainingSection,
)

__all__ = [
    "AlgorithmSection",
    "CheckpointSection",
    "ConfigError",
    "DistillSection",
    "EvalSection",
    "GeneratorParallelismSection",
    "GeneratorSection",
    "JobConfig",
    "JobSection",
    "LoRASection",
    "MetricsSection",
    "ModelSection",
    "ParallelismSection",
    "SFTSection",
    "SamplingSection",
    "TaskSection",
    "TrainingSection",
    "compares_group",
    "load_toml",
    "parse_args",
    "read_json",
    "text_fields",
    "to_toml",
]
