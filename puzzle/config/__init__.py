"""Run configs: one YAML file per run, loaded into validated dataclasses.

`load_config(path)` -> `RunConfig` (puzzle/config/run.py), built by the generic strict loader
`from_data` (puzzle/config/loader.py); `reference_markdown()` (puzzle/config/reference.py) writes the
reference page, docs/CONFIG.md. Every error is a `ConfigError` (a ValueError) naming the file, line and
key path; the `puzzle` command exits with code 2 on one.
"""

from puzzle.config.loader import ConfigError, describe, from_data, read_yaml, to_dict
from puzzle.config.reference import reference_markdown
from puzzle.config.run import (
    DataConfig,
    HardwareConfig,
    ImportanceConfig,
    ParentConfig,
    RoundsConfig,
    RunConfig,
    SearchConfig,
    dump_config,
    load_config,
    load_config_data,
    parse_budget,
)
from puzzle.search.budget import BUDGET_KEYS

__all__ = [
    "BUDGET_KEYS",
    "ConfigError",
    "DataConfig",
    "HardwareConfig",
    "ImportanceConfig",
    "ParentConfig",
    "RoundsConfig",
    "RunConfig",
    "SearchConfig",
    "describe",
    "dump_config",
    "from_data",
    "load_config",
    "load_config_data",
    "parse_budget",
    "read_yaml",
    "reference_markdown",
    "to_dict",
]
