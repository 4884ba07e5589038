"""Budget sweeps: solve the search once per budget value and write the Pareto frontier (CSV, JSON, PNG)."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzle.cost.limits import Bound, BudgetError, Value, merge_limits, parse_value
from puzzle.search.exact import search
from puzzle.search.types import InfeasibleError, Rules, SearchError, Solution, SolverOptions, Table


@dataclass
class SweepPoint:
    """One budget of a sweep and what it gave: a solution, or the reason there is none."""

    limit: Bound
    solution: Solution | None
    error: str | None = None
    on_frontier: bool = False

    def to_json(self) -> dict[str, Any]:
        if self.solution is None:
            return {"budget": str(self.limit), "status": "infeasible", "error": self.error}
        return {"budget": str(self.limit), "on_frontier": self.on_frontier, **self.solution.to_json()}


def parse_sweep(text: str) -> tuple[str, str, list[Value]]:
    """`KEY=v1,v2` or `KEY<=v1,v2` (upper bounds) or `KEY>=v1,v2` (lower bounds) -> (key, side, values)."""
    for separator, side in (("<=", "upper"), (">=", "lower"), ("=", "upper")):
        if separator in text:
            key, _, values = text.partition(separator)
            items = [item for item in values.split(",") if item.strip()]
            if key.strip() and items:
                return key.strip(), side, [parse_value(item, key.strip()) for item in items]
    raise BudgetError(f"cannot read sweep {text!r}: expected KEY=v1,v2,... (values absolute or like 0.6x)")


def frontier_prefix(text: str | Path, overwrite: bool = False) -> Path:
    """Where `write_frontier` writes: `text` itself as a prefix (`out/front` -> out/front.csv ...), or,
    when `text` ends with a path separator or names an existing folder, `frontier` inside that folder.
    The folder is created now and must be writable (SearchError naming it otherwise), so that a sweep
    never runs to the end and then fails to save. A PREFIX.csv, .json or .png already there that an
    earlier sweep did not write (`is_search_output`) is the user's: SearchError unless `overwrite`."""
    raw = str(text)
    prefix = Path(raw)
    if raw.endswith(("/", os.sep)) or prefix.is_dir():
        prefix = prefix / "frontier"
    folder = prefix.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SearchError(f"cannot create the frontier folder {folder}: {error.strerror or error}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SearchError(f"cannot write the frontier into {folder}: permission denied")
    earlier = is_search_output(Path(f"{prefix}.json"))  # its PNG is recognised by it
    files = [Path(f"{prefix}.{suffix}") for suffix in ("csv", "json", "png")]
    users = [
        path.name
        for path in files
        if path.exists() and not (is_search_output(path) or (path.suffix == ".png" and earlier))
    ]
    if users and not overwrite:
        raise SearchError(
            f"refusing to replace {', '.join(users)} in {folder}: not a frontier an earlier sweep wrote; "
            "choose another --frontier PREFIX, or add --overwrite to replace them"
        )
    return prefix


def is_search_output(path: Path) -> bool:
    """Whether `path` is a file `puzzle search` wrote, which a later search may replace: the JSON of an
    answer (a solution, or a list of them: --out; with --baselines inside {"search", "baselines"}) or of a sweep (PREFIX.json), or a sweep's PREFIX.csv.
    Anything else (unreadable, another format) is the user's."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    if path.suffix == ".csv":
        return text.startswith("budget,status,")
    try:
        data = json.loads(text)
    except ValueError:
        return False
    if isinstance(data, dict) and set(data) == {
        "search",
        "baselines",
    }:  # --baselines: the search's answer inside
        data = data["search"]
    items = data if isinstance(data, list) else [data]
    return bool(items) and all(
        isinstance(item, dict) and ("choices" in item or item.get("status") == "infeasible") for item in items
    )


def sweep(
    table: Table,
    limits: Sequence[Bound],
    key: str,
    side: str,
    values: Sequence[Value],
    rules: Rules | None = None,
    options: SolverOptions | None = None,
) -> list[SweepPoint]:
    """Solve once per value of the swept bound (other limits kept; one on the same side of `key` replaced)."""
    points = []
    from puzzle.progress import progress  # tqdm loads only when a sweep runs

    for value in progress(values, f"sweep {key}", total=len(values), unit="solve"):
        swept = Bound(key, upper=value) if side == "upper" else Bound(key, lower=value)
        others = [limit for limit in limits if limit.key != key]
        same_key = [limit for limit in limits if limit.key == key]
        kept = [
            Bound(
                key,
                upper=limit.upper if side == "lower" else None,
                lower=limit.lower if side == "upper" else None,
            )
            for limit in same_key
            if (limit.upper if side == "lower" else limit.lower) is not None
        ]
        combined = merge_limits([*others, *kept, swept])
        try:
            points.append(
                SweepPoint(swept, search(table, combined, rules or Rules(), options or SolverOptions()))
            )
        except InfeasibleError as error:
            points.append(SweepPoint(swept, None, str(error)))
    mark_frontier(points, key, table.maximize)
    return points


def mark_frontier(points: Sequence[SweepPoint], key: str, maximize: bool) -> None:
    """A point is on the frontier when no other has a cost (`key` total) no higher and an objective no
    worse, one of them strictly."""
    solved = [point for point in points if point.solution is not None]
    for point in solved:
        cost, value = point.solution.totals[key], point.solution.objective
        point.on_frontier = True
        for other in solved:
            other_cost, other_value = other.solution.totals[key], other.solution.objective
            no_worse = other_cost <= cost and (other_value >= value if maximize else other_value <= value)
            strictly = other_cost < cost or other_value != value
            if no_worse and strictly:
                point.on_frontier = False
                break


def write_frontier(
    points: Sequence[SweepPoint], key: str, prefix: str | Path, objective_name: str = "objective"
) -> list[Path]:
    """PREFIX.csv and PREFIX.json (budget, objective, status, every cost, architecture) and, when
    matplotlib is installed, PREFIX.png (objective against the swept cost, frontier joined). Returns
    the paths written."""
    prefix = Path(prefix)
    cost_keys = sorted({k for point in points if point.solution for k in point.solution.totals})
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["budget", "status", objective_name, "gap", "on_frontier", *cost_keys, "architecture"])
    for point in points:
        solution = point.solution
        if solution is None:
            writer.writerow([str(point.limit), "infeasible", "", "", False, *[""] * len(cost_keys), ""])
            continue
        writer.writerow(
            [
                str(point.limit),
                solution.status,
                repr(solution.objective),
                "" if solution.gap is None else repr(solution.gap),
                point.on_frontier,
                *[repr(solution.totals.get(k, "")) for k in cost_keys],
                json.dumps(solution.names),
            ]
        )
    written = [Path(f"{prefix}.csv"), Path(f"{prefix}.json")]
    _write(written[0], buffer.getvalue().encode())
    _write(written[1], json.dumps([p.to_json() for p in points], indent=2).encode())
    try:  # a Figure of its own: the caller's pyplot state and backend stay as they were
        from matplotlib.figure import Figure
    except ImportError:  # plotting is an optional extra
        return written
    solved = [p for p in points if p.solution is not None]
    figure = Figure(figsize=(6, 4))
    axis = figure.subplots()
    axis.scatter(
        [p.solution.totals[key] for p in solved],
        [p.solution.objective for p in solved],
        color="grey",
        label="solutions",
    )
    frontier = sorted((p for p in solved if p.on_frontier), key=lambda p: p.solution.totals[key])
    axis.plot(
        [p.solution.totals[key] for p in frontier],
        [p.solution.objective for p in frontier],
        "o-",
        color="tab:blue",
        label="Pareto frontier",
    )
    axis.set_xlabel(key)
    axis.set_ylabel(objective_name)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=120)
    written.append(Path(f"{prefix}.png"))
    _write(written[2], image.getvalue())
    return written


def _write(path: Path, data: bytes) -> None:
    # Late: puzzle.files imports socket, shutil and tempfile, which a search that writes no frontier never uses.
    from puzzle.files import atomic_write_bytes

    try:
        atomic_write_bytes(path, data)
    except OSError as error:
        raise SearchError(f"cannot write {path}: {error.strerror or error}") from None
