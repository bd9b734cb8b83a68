"""JobConfig: the run's schema, TOML loading and the CLI."""

from torchtitan_rl.config.job_config import ConfigError, JobConfig
from torchtitan_rl.config.manager import load_toml, parse_args, to_toml

__all__ = ["ConfigError", "JobConfig", "load_toml", "parse_args", "to_toml"]
