"""`puzzle search`: solve the architecture MIP on a block library file (NVlabs Puzzle or puzzletron format), or
on a run directory (`puzzle search RUN_DIR`: its library, scores and the cost model, `puzzle.problem`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from puzzle.commands import fraction, non_negative_int, parse_number, positive_int
from puzzle.cost.limits import BudgetError, merge_limits, parse_limit
from puzzle.search import InfeasibleError, Rules, SearchError, Solution, SolverOptions, search_k
from puzzle.search.frontier import frontier_prefix, is_search_output, parse_sweep, sweep, write_frontier
from puzzle.search.library import load_library
from puzzle.search.types import SOLVERS

EXIT_INFEASIBLE = 2


class _Deferred(Sequence[str]):
    """Names from a module of the cost model, read on first use: when argparse checks a value of the option or
    formats the help. A library search never uses them, and importing the cost model would be ~70 ms of its
    < 0.5 s. `str()` is the list's, for `%(...)s` in help strings. Options that use one stay in an argument
    group: `ArgumentParser.add_argument` itself formats the choices (a metavar check), a group's does not
    (tests/test_search_cli.py checks that a library search leaves the cost model unimported)."""

    def __init__(self, module: str, names: Callable[[Any], Iterable[str]]) -> None:
        self._module, self._names = module, names
        self._values: list[str] | None = None

    def _list(self) -> list[str]:
        if self._values is None:
            self._values = list(self._names(importlib.import_module(self._module)))
        return self._values

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __len__(self) -> int:
        return len(self._list())

    def __str__(self) -> str:
        return str(self._list())


class _DeferredValue:
    """One name of a module of the cost model (a default), read when the help is formatted (`%(...)s`)."""

    def __init__(self, module: str, name: str) -> None:
        self._module, self._name = module, name

    def __str__(self) -> str:
        return str(getattr(importlib.import_module(self._module), self._name))


_STATE_DTYPES = _Deferred("puzzle.commands.costs", lambda module: module.STATE_DTYPES)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "search",
        help="choose one variant per block under budgets (the Puzzle MIP)",
        description=(
            "Choose one variant per block to optimise the summed objective under budgets. Budgets are "
            "KEY<=VALUE, KEY>=VALUE or LOW<=KEY<=HIGH on dotted keys into each variant; VALUE is absolute "
            "(32000, 7e9, or with a decimal suffix: k=1e3, M=1e6, G or B=1e9, T=1e12, so 70G = 7e10) or "
            "relative to the parent, the first variant of every block (0.6x). A key whose name carries "
            "its unit (stats.memory_mib, stats.runtime_ms) takes plain numbers in that unit: a suffix "
            "there is refused (70G MiB is not 70 GB). Exit code 2 when no architecture meets the "
            "budgets or an option is malformed, 1 for other errors (unreadable library, missing keys). "
            "With RUN_DIR instead of --library: the run's library and scores, costs from the cost model "
            "(budget keys params, active_params, weight_bytes, memory_bytes[S], concurrent_requests[S], "
            "throughput[S], latency[S], ttft[S], user_speed[S], throughput_at_speed[S] (the scenario's speed=) "
            "for scenarios S given with --scenario or by the run's config; "
            "[chat,long] = each; every setting not given is the run's own)."
        ),
    )
    parser.add_argument(
        "run_dir",
        nargs="?",
        default=None,
        metavar="RUN_DIR",
        help="a run directory (parent.json, library/, scores/); instead of --library",
    )
    parser.add_argument(
        "--library",
        default=None,
        help="block library JSON (NVlabs block_library.json or "
        "puzzletron replacement_metrics_and_stats.json)",
    )
    parser.add_argument(
        "--objective",
        default=None,
        help="dotted key of the score (default metrics.kl_div); with RUN_DIR a recorded metric: "
        "kl (default), lm_loss_delta, top1, top5 (1 - agreement, minimised), hidden_nmse",
    )
    parser.add_argument(
        "--maximize", action="store_true", help="maximise the objective (accuracy-like scores)"
    )
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="KEY<=VALUE",
        help="a budget (repeatable); with RUN_DIR, default: the run's own (its config's budgets)",
    )
    parser.add_argument(
        "--fixed",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a cost outside the blocks (embeddings, lm_head) added to KEY's total (repeatable)",
    )
    parser.add_argument(
        "--keep-block",
        action="append",
        default=[],
        metavar="LAYER",
        help="hold this layer at its parent (first) variant (repeatable)",
    )
    parser.add_argument(
        "--same",
        action="append",
        default=[],
        metavar="KEY",
        help="every chosen variant that has KEY has the same value of it, e.g. an SSM state "
        "size (repeatable; missing or null = free)",
    )
    parser.add_argument(
        "--solutions",
        type=positive_int,
        default=1,
        metavar="K",
        help="the K best distinct architectures (default 1)",
    )
    parser.add_argument(
        "--min-diff",
        type=positive_int,
        default=None,
        metavar="D",
        help="with --solutions K > 1: each further solution differs from every earlier one in >= D "
        "blocks (default 1)",
    )
    parser.add_argument(
        "--sweep", metavar="KEY=v1,v2,...", help="solve once per bound on KEY (KEY>=... for lower bounds)"
    )
    parser.add_argument(
        "--frontier",
        metavar="PREFIX",
        help="with --sweep: write PREFIX.csv, PREFIX.json, PREFIX.png; a PREFIX ending in / or naming an "
        "existing folder writes frontier.csv, .json, .png inside that folder",
    )
    parser.add_argument(
        "--solver",
        choices=SOLVERS,
        default=None,
        help="MIP solver (default auto: HiGHS if highspy is installed, else CBC; with RUN_DIR the run's "
        "search.solver)",
    )
    parser.add_argument(
        "--time-limit",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="wall-clock limit per solve in seconds, > 0 (default: none; with RUN_DIR the run's); "
        "a solve stopped by it reports status time_limit",
    )
    parser.add_argument(
        "--gap",
        type=_relative_gap,
        default=None,
        help="relative optimality gap to prove, in [0, 1) (default 1e-6; with RUN_DIR the run's); status "
        "optimal means the "
        "proven gap, (objective - best bound) / |objective|, is at most this",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="let --out FILE or --frontier PREFIX replace files that an earlier search did not write "
        "(without it they are refused before solving)",
    )
    run_dir = parser.add_argument_group(
        "with RUN_DIR: the cost model, as `puzzle costs` counts; each setting not given is the run's own "
        "(RUN_DIR/run.resolved.yaml, or config.yaml in older runs), as are --objective, --keep-block, "
        "--same, --solver, --time-limit and --gap"
    )
    run_dir.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME:batch=B,prompt=P,generated=G",
        help="a serving scenario budgets may name (repeatable; also speed= tokens/s per user, recipe=, "
        "kv_dtype=, ssm_dtype=, conv_dtype=, activation_dtype=, compute_dtype=); the run's own scenarios are "
        "defined without it "
        "(one given here replaces the run's of that name)",
    )
    hardware = run_dir.add_argument(
        "--hardware",
        default=None,
        help="the device that times scenarios and holds requests: one of %(names)s, or NxNAME for N GPUs "
        "(8xb200) (default: the run's "
        "hardware.profile, else %(default_name)s; this-machine is the run's stored calibration, "
        "RUN_DIR/hardware.json, measured and stored once if absent)",
    )
    hardware.names = _Deferred("puzzle.cost.hardware", lambda module: module.hardware_names())
    hardware.default_name = _DeferredValue("puzzle.cost.hardware", "DEFAULT_HARDWARE")
    run_dir.add_argument(
        "--recipe",
        default=None,
        choices=_Deferred("puzzle.cost.formats", lambda module: sorted(module.RECIPES)),
        help="weight storage format of weight_bytes and of every scenario (default: the run's "
        "hardware.recipe and its scenarios' own, else bf16)",
    )
    run_dir.add_argument(
        "--kv-dtype",
        default=None,
        choices=_STATE_DTYPES,
        help="every scenario's KV cache (default: the run's scenarios' own, else bf16)",
    )
    run_dir.add_argument(
        "--ssm-dtype",
        default=None,
        choices=_STATE_DTYPES,
        help="every scenario's Mamba state (default: the run's scenarios' own, else fp32)",
    )
    memory_fraction = run_dir.add_argument(
        "--memory-fraction",
        type=fraction,
        default=None,
        metavar="FRACTION",
        help="share of the device memory usable by concurrent_requests, in (0, 1] (default: the run's "
        "hardware.memory_fraction, else %(default_fraction)s)",
    )
    memory_fraction.default_fraction = _DeferredValue("puzzle.cost.hardware", "DEFAULT_MEMORY_FRACTION")
    run_dir.add_argument(
        "--parent",
        default=None,
        metavar="TARGET",
        help="the parent's spec as `puzzle costs` takes it (preset, checkpoint dir, config.json), "
        "instead of RUN_DIR/parent.json",
    )
    run_dir.add_argument(
        "--mixed-state-sizes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let Mamba blocks keep different SSM state sizes, or (--no-mixed-state-sizes) not (default: "
        "the run's search.shared_state_size, else one size, as serving engines need)",
    )
    run_dir.add_argument(
        "--rerank",
        type=non_negative_int,
        default=None,
        metavar="K",
        help="measured re-ranking of the K best architectures (0 or 1: off) needs the parent and the run's "
        "held-out tokens, which this command does not load: set search.rerank: K in the run config and run "
        "`puzzle run CONFIG --until solutions`",
    )
    run_dir.add_argument(
        "--baselines",
        action="store_true",
        help="also print what the baselines choose at the same budgets, on the same scores (greedy "
        "descent with and without refill, uniform pruning with and without no-op blocks, a random draw "
        "and a random walk at the budget; puzzle.baselines), each with its predicted objective and "
        'totals; with --json the answer becomes {"search": ..., "baselines": {name: ...}}',
    )
    run_dir.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="also write the JSON answer to FILE (atomically); if it cannot be written, the answer is "
        "still printed and the exit code is 2",
    )
    parser.set_defaults(func=run, parser_error=parser.error)


def _positive_seconds(text: str) -> float:
    """argparse type for --time-limit: a finite number of seconds > 0 (`90`, `1e3`), as numbers read
    everywhere on the command line (`puzzle.commands.parse_number`)."""
    value = parse_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, found {text!r}")
    return value


def _relative_gap(text: str) -> float:
    """argparse type for --gap: a relative gap in [0, 1)."""
    value = parse_number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a relative gap in [0, 1) such as 1e-6, found {text!r}")
    return value


def _fixed(items: list[str]) -> dict[str, float]:
    fixed: dict[str, float] = {}
    for item in items:
        key, separator, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not separator or not key.strip() or not math.isfinite(number):
            raise BudgetError(f"cannot read --fixed {item!r}: expected KEY=NUMBER (a finite number)")
        fixed[key.strip()] = number
    return fixed


_RUN_DIR_ONLY = (
    "scenario",
    "hardware",
    "recipe",
    "kv_dtype",
    "ssm_dtype",
    "memory_fraction",
    "parent",
    "mixed_state_sizes",
    "rerank",
    "baselines",
    "out",
)
_LIBRARY_ONLY = ("fixed", "maximize", "sweep", "frontier")
_SWITCHES = (
    "maximize",
    "baselines",
)  # store_true options: False is their unset value (--no-mixed-state-sizes is set)


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_combinations(parser_error: Any, args: argparse.Namespace) -> None:
    """Options that only mean something together with another one: an error, never silence."""
    if (args.run_dir is None) == (args.library is None):
        parser_error(
            "give either RUN_DIR or --library FILE" + (", not both" if args.run_dir is not None else "")
        )
    mode, others = ("RUN_DIR", _LIBRARY_ONLY) if args.run_dir is not None else ("--library", _RUN_DIR_ONLY)
    for dest in others:
        value = getattr(args, dest)
        if value not in (None, []) and not (value is False and dest in _SWITCHES):
            parser_error(f"{_option(dest)} does not apply with {mode}")
    if args.rerank is not None and args.rerank > 1:
        parser_error(
            f"--rerank {args.rerank} assembles each candidate and measures its KL to the parent on the run's "
            "held-out tokens, which `puzzle search` does not load; set search.rerank: "
            f"{args.rerank} in the run config and run `puzzle run CONFIG --until solutions` (RUN_DIR/run.json "
            "then records every candidate's predicted and measured KL)"
        )
    if args.frontier is not None and args.sweep is None:
        parser_error("--frontier needs --sweep (it writes the sweep's points)")
    if args.min_diff is not None and args.solutions == 1:
        parser_error("--min-diff needs --solutions K with K > 1 (it spaces the K solutions apart)")
    if args.sweep is not None and (args.solutions != 1 or args.min_diff is not None):
        parser_error("--solutions / --min-diff do not combine with --sweep (one solution per point)")


def _print_solution(solution: Solution, objective: str, out) -> None:
    width = max(len(block) for block in solution.names)
    for block, variant in solution.names.items():
        print(f"  {block:<{width}}  {variant}", file=out)
    gap = "n/a" if solution.gap is None else f"{solution.gap:.2g}"
    print(
        f"{objective} = {solution.objective:.6g}   status {solution.status}, gap {gap}, {solution.solver}, "
        f"{solution.seconds:.2f} s, {solution.presolve_dropped} dominated variants dropped",
        file=out,
    )
    for key, value in solution.totals.items():
        print(f"  {key} = {value:.6g}", file=out)


def run(args: argparse.Namespace) -> int:
    _check_combinations(args.parser_error, args)
    if args.run_dir is not None:
        return _run_dir(args)
    if args.objective is None:
        args.objective = "metrics.kl_div"
    try:
        limits = merge_limits(parse_limit(text) for text in args.budget)
        swept = parse_sweep(args.sweep) if args.sweep is not None else None
        # Where the frontier goes is settled before solving, so a bad path loses no solve.
        frontier = frontier_prefix(args.frontier, args.overwrite) if args.frontier else None
        keys = [limit.key for limit in limits] + ([swept[0]] if swept else [])
        table = load_library(args.library, args.objective, keys, args.maximize, args.same, _fixed(args.fixed))
        rules = Rules(same_attributes=tuple(args.same), keep_blocks=tuple(args.keep_block))
        options = SolverOptions(
            args.solver or "auto", args.time_limit, 1e-6 if args.gap is None else args.gap
        )
        if swept:
            key, side, values = swept
            points = sweep(table, limits, key, side, values, rules, options)
            if frontier is not None:
                for path in write_frontier(points, key, frontier, args.objective):
                    print(f"wrote {path}", file=sys.stderr)
            if args.json:
                print(json.dumps([point.to_json() for point in points], indent=2))
            else:
                for point in points:
                    mark = "*" if point.on_frontier else " "
                    if point.solution is None:
                        print(f"{mark} {point.limit}: infeasible: {point.error}")
                    else:
                        print(
                            f"{mark} {point.limit}: {args.objective} = {point.solution.objective:.6g}, "
                            f"{key} = {point.solution.totals[key]:.6g} ({point.solution.status})"
                        )
            return 0 if any(point.solution is not None for point in points) else EXIT_INFEASIBLE
        min_diff = 1 if args.min_diff is None else args.min_diff
        solutions = search_k(table, limits, rules, options, args.solutions, min_diff)
    except InfeasibleError as error:
        if args.json:
            print(
                json.dumps(
                    {"status": "infeasible", "error": str(error), "budget": error.budget, "best": error.best}
                )
            )
        print(f"puzzle search: infeasible: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (SearchError, BudgetError) as error:
        print(f"puzzle search: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        payload = [s.to_json() for s in solutions]
        print(json.dumps(payload[0] if args.solutions == 1 else payload, indent=2))
        return 0
    for index, solution in enumerate(solutions):
        if len(solutions) > 1:
            print(f"solution {index + 1}:")
        _print_solution(solution, args.objective, sys.stdout)
    if len(solutions) < args.solutions:
        print(f"only {len(solutions)} architectures differ in >= {min_diff} blocks", file=sys.stderr)
    return 0


def _run_config(layout: Any) -> Any:
    """The run config a pipeline run saved in its directory (`RunLayout.resolved_config`); None without one.

    A ConfigError is a ValueError: a malformed saved config exits 2, naming the file."""
    from puzzle.config import load_config

    path = layout.resolved_config
    return load_config(path) if path.is_file() else None


def _run_budgets(layout: Any, config: Any) -> list[str]:
    """Without --budget: the budgets the run's solutions stage searched with (its config's, for the round of
    RUN_DIR), as every other setting not given. BudgetError when there is no saved config, or when the run
    solved several budget lists (a sweep): which one is meant is the user's to say."""
    if config is None:
        raise BudgetError(
            f"no --budget given, and {layout.root} has no saved run config to take the run's budgets from; "
            "give --budget KEY<=VALUE (e.g. --budget 'active_params<=0.7x')"
        )
    try:
        number = json.loads(layout.manifest.read_text()).get("round", 1)
    except (OSError, ValueError, AttributeError):
        number = 1  # no manifest (yet): the run's first round
    index = number - 1 if isinstance(number, int) and 1 <= number <= config.rounds.count else 0
    solves = config.round_budgets(index)
    if len(solves) != 1:
        listed = "; ".join(", ".join(solve) for solve in solves)
        raise BudgetError(
            f"no --budget given, and the run searched {len(solves)} budget lists ({listed}); choose one with "
            f"--budget, e.g. --budget {solves[0][0]!r}"
        )
    return solves[0]


def _with_dtypes(scenario: Any, args: argparse.Namespace) -> Any:
    """A run scenario with the dtypes given on the command line (--recipe, --kv-dtype, --ssm-dtype)."""
    given = {"recipe": args.recipe, "kv_dtype": args.kv_dtype, "ssm_dtype": args.ssm_dtype}
    return dataclasses.replace(scenario, **{key: value for key, value in given.items() if value is not None})


@dataclasses.dataclass(frozen=True)
class _RunSearch:
    """What `puzzle search RUN_DIR` searches with: each option given, else the run config's, else the default."""

    cost_model: Any  # puzzle.cost.serving.CostModel, its profile still a name
    objective: str
    keep_blocks: tuple[Any, ...]
    same_attributes: tuple[str, ...]
    shared_state_size: bool
    options: SolverOptions


def _run_search(args: argparse.Namespace, config: Any) -> _RunSearch:
    """Settings of `puzzle search RUN_DIR` from the options and the run's config (None: no saved config).

    The run's solutions stage searched with the config's `hardware` and `search` sections, so that is
    what a search of its directory starts from; an option overrides the one setting it names."""
    from puzzle.config.run import SearchConfig
    from puzzle.cost.hardware import hardware_key
    from puzzle.cost.serving import CostModel, parse_scenario

    hardware = config.hardware if config is not None else CostModel()
    settings = config.search if config is not None else SearchConfig()
    name = args.hardware if args.hardware is not None else hardware.profile
    hardware_key(name)  # SpecError (exit 2) for an unknown name, before any file is read
    recipe = args.recipe or hardware.recipe
    defaults = {"recipe": recipe, "kv_dtype": args.kv_dtype or "bf16", "ssm_dtype": args.ssm_dtype or "fp32"}
    scenarios = {}
    for text in args.scenario:
        scenario = parse_scenario(text, defaults)
        if scenario.name in scenarios:
            raise BudgetError(f"--scenario {scenario.name!r} is defined twice")
        scenarios[scenario.name] = scenario
    for scenario_name, scenario in hardware.scenarios.items():
        scenarios.setdefault(scenario_name, _with_dtypes(scenario, args))  # --scenario replaces the run's
    memory_fraction = hardware.memory_fraction if args.memory_fraction is None else args.memory_fraction
    solver = settings.solver
    options = dataclasses.replace(
        solver,
        solver=args.solver or solver.solver,
        time_limit_s=solver.time_limit_s if args.time_limit is None else args.time_limit,
        gap_rel=solver.gap_rel if args.gap is None else args.gap,
    )
    mixed = args.mixed_state_sizes
    return _RunSearch(
        cost_model=CostModel(name, memory_fraction, recipe, scenarios, hardware.price_as),
        objective=settings.objective if args.objective is None else args.objective,
        keep_blocks=tuple(args.keep_block) or settings.keep_blocks,
        same_attributes=tuple(args.same) or settings.same_attributes,
        shared_state_size=settings.shared_state_size if mixed is None else not mixed,
        options=options,
    )


def _run_dir(args: argparse.Namespace) -> int:
    """`puzzle search RUN_DIR`: malformed options exit 2 before any file is read; an unusable run exits 1."""
    # Late: the run's files are read through puzzle.bld / puzzle.score, which import torch.
    from puzzle.commands.costs import load_target
    from puzzle.layout import RunLayout
    from puzzle.problem import METRICS, run_problem
    from puzzle.search.budget import factor_hints, parse_budget

    layout = RunLayout(Path(args.run_dir))
    try:
        config = _run_config(layout)
        found = _run_search(args, config)
        if found.objective not in METRICS:
            raise BudgetError(
                f"--objective {found.objective!r} is not a recorded metric; choose one of {', '.join(METRICS)}"
            )
        bad_same = sorted(set(found.same_attributes) - {"state_size", "top_k", "kind"})
        if bad_same:
            raise BudgetError(f"--same {bad_same[0]!r}: a run's variants have state_size, top_k and kind")
        texts = args.budget or _run_budgets(layout, config)
        budgets = [parse_budget(text, found.cost_model) for text in texts]
        out = Path(args.out) if args.out is not None else None
        if out is not None and (out.is_dir() or not out.name):
            raise BudgetError(f"--out {args.out!r} is a directory; name the file to write")
        if out is not None and out.exists() and not args.overwrite and not is_search_output(out):
            raise BudgetError(
                f"refusing to replace --out {out}: it is not an answer `puzzle search` wrote; name a new "
                "file, or add --overwrite to replace it"
            )
        parent = load_target(args.parent) if args.parent is not None else None
        parent = parent[0] if parent is not None else None
    except ValueError as error:  # BudgetError, SpecError, CheckpointError, ConfigError
        print(f"puzzle search: error: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE  # 2: bad input, as argparse's usage errors
    if not args.budget:
        print(f"puzzle search: note: the run's budgets: {', '.join(texts)}", file=sys.stderr)
    objective = found.objective
    try:
        # The hardware as the run prices it: "this-machine" is the run's stored calibration.
        cost_model = dataclasses.replace(found.cost_model, profile=layout.hardware(found.cost_model.profile))
        problem = run_problem(
            layout,
            budgets,
            objective=objective,
            cost_model=cost_model,
            keep_blocks=found.keep_blocks,
            same_attributes=found.same_attributes,
            shared_state_size=found.shared_state_size,
            parent=parent,
        )
        for note in problem.notes:
            print(f"puzzle search: note: {note}", file=sys.stderr)
        min_diff = 1 if args.min_diff is None else args.min_diff
        rules = problem.problem.rules
        solutions = search_k(
            problem.table, problem.problem.limits, rules, found.options, args.solutions, min_diff
        )
    except InfeasibleError as error:
        if args.json:
            print(
                json.dumps(
                    {"status": "infeasible", "error": str(error), "budget": error.budget, "best": error.best}
                )
            )
        print(f"puzzle search: infeasible: {error}", file=sys.stderr)
        if error.budget in problem.sources:
            print(
                f"puzzle search: ({error.budget} is --budget {problem.sources[error.budget]!r})",
                file=sys.stderr,
            )
        for hint in factor_hints(budgets, problem.candidates.parent, cost_model):
            print(f"puzzle search: {hint}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except ValueError as error:  # SearchError, RunDirError, ArtifactError, SpecError: an unusable run
        print(f"puzzle search: error: {error}", file=sys.stderr)
        return 1
    payload = [s.to_json() for s in solutions]
    answer = payload[0] if args.solutions == 1 else payload
    compared = _baselines(problem, solutions[0]) if args.baselines else None
    if compared is not None:
        answer = {"search": answer, "baselines": compared}
    # The answer is printed before --out is written, so that a file that cannot be written loses nothing.
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        for index, solution in enumerate(solutions):
            if len(solutions) > 1:
                print(f"solution {index + 1}:")
            _print_solution(solution, objective, sys.stdout)
        if compared is not None:
            _print_baselines(compared, solutions[0], objective, sys.stdout)
    if len(solutions) < args.solutions:
        print(f"only {len(solutions)} architectures differ in >= {min_diff} blocks", file=sys.stderr)
    if out is not None:
        return _write_out(out, answer)
    return 0


def _baselines(problem: Any, solution: Solution) -> dict[str, Any]:
    """{baseline name: {"objective", "choices", "totals"} or None where it meets no architecture} of
    `puzzle.baselines` on `problem`, each trading the first budget's cost column (the search's answer is
    `solution`); totals are those of the budgets' own columns."""
    from puzzle.baselines import Baselines, budget_column

    column = budget_column(problem)
    found = Baselines(problem, budget=column).all(seed=0)
    keys = list(dict.fromkeys(limit.key for limit in problem.problem.limits)) or [column]
    compared: dict[str, Any] = {}
    for name, arch in found.items():
        if arch is None:
            compared[name] = None
            continue
        choices = [problem.candidates.variants[b].index(spec) for b, spec in enumerate(arch)]
        totals = problem.table.totals(choices)
        compared[name] = {
            "objective": float(problem.table.score[problem.table.offsets[:-1] + choices].sum()),
            "choices": dict(
                zip(
                    problem.table.block_names,
                    (problem.table.variant_names[b][j] for b, j in enumerate(choices)),
                )
            ),
            "totals": {key: totals[key] for key in keys},
        }
    return compared


def _print_baselines(compared: Mapping[str, Any], solution: Solution, objective: str, out: Any) -> None:
    """The baselines' objectives beside the search's, and their budget totals, one line each."""
    print(f"baselines at the same budgets ({objective}, predicted from the same scores):", file=out)
    width = max(len(name) for name in compared)
    print(f"  {'search':<{width}}  {solution.objective:.6g}", file=out)
    for name, entry in compared.items():
        if entry is None:
            print(f"  {name:<{width}}  none meets the budgets", file=out)
            continue
        ratio = entry["objective"] / solution.objective if solution.objective > 0 else math.nan
        totals = ", ".join(f"{key} = {value:.6g}" for key, value in entry["totals"].items())
        print(f"  {name:<{width}}  {entry['objective']:.6g}  ({ratio:.2f}x the search's)  {totals}", file=out)


def _write_out(out: Path, answer: Any) -> int:
    """Write the JSON answer to --out; 0, or 2 with a message naming the path if it cannot be written."""
    from puzzle.files import atomic_write_bytes

    try:
        atomic_write_bytes(out, (json.dumps(answer, indent=2) + "\n").encode())
    except OSError as error:
        reason = error.strerror or str(error)
        print(
            f"puzzle search: error: cannot write --out {out}: {reason} (the answer is printed above)",
            file=sys.stderr,
        )
        return EXIT_INFEASIBLE  # 2: bad input
    print(f"wrote {out}", file=sys.stderr)
    return 0
