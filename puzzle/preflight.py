"""The checks a run makes before its first stage, in one function: `puzzle run` makes them, and `puzzle config
check` makes exactly the same ones (so what one accepts the other does not refuse).

Reads the config, the parent's config.json and safetensors headers, never a weight: the run directory may be
written (`Run.check_run_dir`), every budget is met by some architecture of the space (`Run.check_budgets`: the
search over every variant of the space priced by the run's cost model, so the cheapest architecture the space
allows is tried), every stage fits the memory per rank as `puzzle plan` estimates it, and what the run
still has to write fits the free disk under run_dir (`puzzle.plan.run_misfits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from puzzle.config import ConfigError, RunConfig
from puzzle.plan import run_misfits
from puzzle.run import Run, RunError
from puzzle.search.budget import factor_hints
from puzzle.search.types import InfeasibleError


@dataclass
class Preflight:
    """The run of a config and what refuses it: one line each, `error: ...`, `infeasible: ...` or
    `does not fit: ...` (empty: the run may start)."""

    run: Run
    problems: list[str] = field(default_factory=list)


def preflight(config: RunConfig, *, plan_check: bool = True, world: int | None = None) -> Preflight:
    """The checks `puzzle run` makes before its first stage, on a config loaded with its paths checked.

    `plan_check`: also `puzzle plan`'s memory check on `world` ranks (default: WORLD_SIZE). A budget that no
    architecture meets and whose bare value looks like a forgotten factor (`active_params<=0.75`) gets a
    "did you mean active_params<=0.75x?" line (`puzzle.search.budget.factor_hints`)."""
    run = Run(config.run_dir, config)
    found = Preflight(run)
    try:
        run.check_run_dir()  # before anything: a folder of the user's files is refused untouched
        parent = config.validate_paths()
        try:
            run.check_budgets(parent)
        except InfeasibleError as error:
            limits = [limit for solve in run.budget_limits().values() for limit in solve]
            hints = factor_hints(limits, parent, run.cost_model(store=False))
            found.problems.append("; ".join([f"infeasible: {error}", *hints]))
            return found
    except (RunError, ConfigError) as error:
        found.problems.append(f"error: {error}")
        return found
    if plan_check:
        found.problems += [f"does not fit: {line} (see `puzzle plan`)" for line in run_misfits(config, world)]
    return found
