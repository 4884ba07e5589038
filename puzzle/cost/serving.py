"""Where a child will be served, as budgets name it: the `CostModel` (accelerator profile, memory fraction,
weight recipe, named scenarios) and the scenario grammar (`chat:batch=8,prompt=1k,generated=256`).

The budget rows (`puzzle.search.budget`), `puzzle costs`, `puzzle search` and the run config read a
scenario with `parse_scenario` and a serving target with `CostModel`; both only check and hold values.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puzzle.cost.analytic import get_recipe
from puzzle.cost.hardware import DEFAULT_HARDWARE, DEFAULT_MEMORY_FRACTION, HardwareProfile, hardware_key
from puzzle.cost.limits import BudgetError, Relative, parse_value
from puzzle.cost.roofline import Scenario
from puzzle.spec import SpecError


@dataclass(frozen=True)
class CostModel:
    """Where the child will be served: the accelerator profile (roofline timing, memory) and the named
    serving scenarios that budgets refer to (`throughput[chat]`).

    `profile`: Accelerator profile of puzzle.cost (h100-80gb, h200-141gb, b200, a100-80gb, this-machine;
    aliases such as h100 accepted; `NxNAME` such as 8xb200 for N GPUs serving tensor/expert parallel); in
    Python also a `HardwareProfile` (a run's stored calibration).
    `memory_fraction`: Share of the device memory usable for weights and requests.
    `recipe`: Weight storage for weight_bytes budgets (bf16, fp8, nvfp4, ...).
    `scenarios`: Serving scenarios by name: batch_size, prompt_tokens, generated_tokens and dtypes (see
    Scenario).
    `price_as`: A model whose shapes price the budgets in place of the parent's: a checkpoint folder or its
    config.json (null: the parent). Each variant is priced as the same change to that model's block
    (`puzzle.search.price_as`): a small parent with a full-size model's block pattern is searched under the
    full-size costs, to rehearse a full-size run.
    """

    profile: str | HardwareProfile = DEFAULT_HARDWARE
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    recipe: str = "bf16"
    scenarios: dict[str, Scenario] = field(default_factory=dict)
    price_as: Path | None = None

    def __post_init__(self) -> None:
        # Messages name the field as `CostModel.FIELD`, which the config loader turns into `hardware.FIELD`.
        if isinstance(self.profile, str):
            try:
                object.__setattr__(self, "profile", hardware_key(self.profile))
            except SpecError as error:
                raise BudgetError(f"CostModel.profile: {error}") from None
        elif not isinstance(self.profile, HardwareProfile):
            raise BudgetError(
                f"CostModel.profile must be a hardware name or a HardwareProfile, found {self.profile!r}"
            )
        try:
            get_recipe(self.recipe)
        except ValueError as error:
            raise BudgetError(f"CostModel.recipe: {error}") from None
        fraction = self.memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise BudgetError(f"CostModel.memory_fraction must be a fraction in (0, 1], found {fraction!r}")
        named = {}
        for name, scenario in self.scenarios.items():
            if scenario.name not in ("", name):
                raise BudgetError(
                    f"CostModel.scenarios.{name}.name: name {scenario.name!r} differs from its key {name!r}"
                )
            named[name] = scenario if scenario.name == name else dataclasses.replace(scenario, name=name)
        object.__setattr__(self, "scenarios", named)
        if self.price_as is not None:
            if not isinstance(self.price_as, (str, Path)) or not str(self.price_as).strip():
                raise BudgetError(
                    f"CostModel.price_as must be a checkpoint folder or a config.json path, found {self.price_as!r}"
                )
            object.__setattr__(self, "price_as", Path(self.price_as).expanduser())


# ---------------------------------------------------------------------------------------------- scenarios

# --scenario fields: short name -> Scenario field; the first three are required.
SCENARIO_FIELDS: dict[str, str] = {
    "batch": "batch_size",
    "prompt": "prompt_tokens",
    "generated": "generated_tokens",
    "recipe": "recipe",
    "kv_dtype": "kv_dtype",
    "ssm_dtype": "ssm_dtype",
    "conv_dtype": "conv_dtype",
    "activation_dtype": "activation_dtype",
    "compute_dtype": "compute_dtype",
    "speed": "user_speed",
}
SCENARIO_SYNTAX = "NAME:batch=B,prompt=P,generated=G[,speed=TOKENS_PER_S,recipe=R,kv_dtype=D,...]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_scenario(text: str, defaults: Mapping[str, str] | None = None) -> Scenario:
    """`'chat:batch=8,prompt=1k,generated=256'` -> Scenario(8, 1000, 256, name='chat').

    Counts take the budget syntax's suffixes (1k = 1000); `defaults` fills the dtype fields not given
    (recipe, kv_dtype, ssm_dtype... as `puzzle costs` names them). BudgetError naming the text otherwise.
    """
    name, separator, body = text.partition(":")
    name = name.strip()
    if not separator or not _NAME.fullmatch(name):
        raise BudgetError(f"cannot read scenario {text!r}: expected {SCENARIO_SYNTAX}")
    values: dict[str, Any] = dict(defaults or {})
    for item in body.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or key not in SCENARIO_FIELDS or not value:
            raise BudgetError(
                f"scenario {name!r}: cannot read {item.strip()!r}; expected KEY=VALUE with KEY one of "
                f"{', '.join(SCENARIO_FIELDS)} ({SCENARIO_SYNTAX})"
            )
        field_name = SCENARIO_FIELDS[key]
        if field_name.endswith("_tokens") or field_name == "batch_size":
            number = parse_value(value)
            if isinstance(number, Relative) or not float(number).is_integer() or number < 1:
                raise BudgetError(f"scenario {name!r}: {key} must be a whole number >= 1, found {value!r}")
            values[field_name] = int(number)
        elif field_name == "user_speed":
            number = parse_value(value)
            if isinstance(number, Relative) or number <= 0:
                raise BudgetError(f"scenario {name!r}: speed must be tokens/s per user > 0, found {value!r}")
            values[field_name] = float(number)
        else:
            values[field_name] = value
    missing = [key for key in ("batch", "prompt", "generated") if SCENARIO_FIELDS[key] not in values]
    if missing:
        raise BudgetError(f"scenario {name!r} needs {', '.join(missing)} ({SCENARIO_SYNTAX})")
    try:
        return Scenario(**values, name=name)
    except SpecError as error:
        raise BudgetError(f"scenario {name!r}: {error}") from None
