"""docs/SCALE.md quotes `puzzle plan`: its tables, its excerpts and every figure in its prose are the output of
the commands written next to them, run here (the plan is analytic: config.json files only, seconds on a CPU).

The page's conventions, which these tests read:
- a table's heading names its command and exit code, `### TITLE: \\`puzzle plan ARGS\\` (exit N)`, and is
  followed by `Usable memory per rank: X GiB.` and the table, one row per stage, every cell as the text output
  prints it (`table_for` renders it from the same plan);
- a ```text block starting `$ puzzle plan ARGS` (optionally `# with KEY: VALUE, KEY: VALUE`, a copy of the
  config with those keys set) holds lines of that command's text output, in order, `...` standing for any
  lines in between;
- every `N.N GiB` and every time (`N.N h`, `N.N d`, `N.N min`, `N.N s`) anywhere on the page is printed by
  one of the page's commands.

When the plan changes, the failure shows the table or line the page should now hold.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from puzzle.cli import main
from puzzle.plan import _count, _duration, _gib, _hours

ROOT = Path(__file__).resolve().parents[1]
SCALE = ROOT / "docs" / "SCALE.md"
HEADING = re.compile(r"^### (?P<title>[^:]+): `(?P<command>puzzle plan [^`]+)` \(exit (?P<exit>\d)\)$")
WITH = re.compile(r"\s+# with (?P<keys>.+)$")
FIGURE = re.compile(r"\b\d+\.\d (?:GiB|h|d|min|s)\b")
TABLE_HEADER = (
    "| stage | work | tokens | time | GPU-hours | peak / rank | largest part | fits | disk |",
    "|---|---|---|---|---|---|---|---|---|",
)


def run_plan(command: str, tmp_path: Path, *, as_json: bool = False) -> tuple[int, str]:
    """(exit code, stdout) of `puzzle plan ...` as the page writes it, run in-process from the repository's
    root; `# with KEY: VALUE, ...` plans a copy of the config with those keys set."""
    overrides: dict[str, Any] = {}
    if match := WITH.search(command):
        command = command[: match.start()]
        for item in match["keys"].split(", "):
            key, value = item.split(": ", 1)
            overrides[key] = yaml.safe_load(value)
    args = shlex.split(command)
    assert args[:2] == ["puzzle", "plan"], command
    args = args[1:]
    config = (ROOT / args[1]).resolve()
    if overrides:
        data = yaml.safe_load(config.read_text())
        parent = Path(data["parent"]["path"])
        data["parent"]["path"] = str(parent if parent.is_absolute() else (config.parent / parent).resolve())
        for key, value in overrides.items():
            *path, last = key.split(".")
            node = data
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        config = tmp_path / config.name
        config.write_text(yaml.safe_dump(data))
    args[1] = str(config)
    args = [a if not a.startswith("examples/") else str(ROOT / a) for a in args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*args, *(["--json"] if as_json else [])])
    return code, out.getvalue()


def table_for(plan: dict[str, Any]) -> list[str]:
    """The page's table of a plan (`puzzle plan --json`), each cell as the text output prints it."""
    limit = plan["memory_limit_bytes"]
    rows = [*TABLE_HEADER]
    for stage in plan["stages"]:
        memory = {name: value for name, value in stage["memory"].items() if value}
        largest = max(memory, key=lambda name: memory[name]) if memory else None
        cells = [
            stage["stage"],
            stage["units"],
            "-" if stage["tokens"] is None else _count(stage["tokens"]),
            "-" if stage["seconds"] is None else _duration(stage["seconds"]),
            "-" if stage["gpu_hours"] is None else _hours(stage["gpu_hours"]),
            _gib(stage["peak_bytes"]),
            "-" if largest is None else f"{largest} {_gib(memory[largest])}",
            "yes" if stage["peak_bytes"] <= limit else "**no**",
            _gib(stage["disk_bytes"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def page_tables(text: str) -> list[tuple[str, str, int, str, list[str]]]:
    """(title, command, exit code, usable-memory line, table lines) of every plan table on the page."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        if match := HEADING.match(line):
            rest = [x for x in lines[i + 1 :] if x.strip()]
            usable, table = rest[0], []
            for row in rest[1:]:
                if not row.startswith("|"):
                    break
                table.append(row)
            found.append((match["title"], match["command"], int(match["exit"]), usable, table))
    return found


def page_excerpts(text: str) -> list[tuple[str, list[str]]]:
    """(command, quoted output lines) of every ```text block of the page that starts with `$ puzzle plan`."""
    found = []
    for block in re.findall(r"^```text\n(.*?)^```$", text, flags=re.M | re.S):
        first, *quoted = block.rstrip("\n").split("\n")
        if first.startswith("$ puzzle plan "):
            found.append((first[2:], quoted))
    return found


@pytest.fixture(scope="module")
def page() -> str:
    return SCALE.read_text()


def test_the_page_quotes_its_tables_and_excerpts(page):
    assert len(page_tables(page)) >= 4 and len(page_excerpts(page)) >= 3


def test_each_table_is_its_command_output(page, tmp_path):
    for title, command, exit_code, usable, table in page_tables(page):
        code, out = run_plan(command, tmp_path, as_json=True)
        plan = json.loads(out)
        expected = table_for(plan)
        assert code == exit_code, f"{title}: `{command}` exits {code}, the page says {exit_code}"
        assert usable == f"Usable memory per rank: {_gib(plan['memory_limit_bytes'])}.", title
        assert table == expected, f"{title}: the table of `{command}` is now:\n" + "\n".join(expected)


def _in_order(quoted: list[str], output: list[str]) -> str | None:
    """The first quoted line not found in `output` after the previous one ('...' skips), or None."""
    position = 0
    for line in quoted:
        if line == "...":
            continue
        try:
            position = output.index(line, position) + 1
        except ValueError:
            return line
    return None


def test_each_excerpt_is_its_command_output(page, tmp_path):
    for command, quoted in page_excerpts(page):
        _, out = run_plan(command, tmp_path)
        missing = _in_order(quoted, out.splitlines())
        assert missing is None, f"`{command}` prints no line\n{missing}\n(in that order); it prints:\n{out}"


def test_every_figure_on_the_page_is_printed_by_one_of_its_commands(page, tmp_path):
    commands = [c for _, c, _, _, _ in page_tables(page)] + [c for c, _ in page_excerpts(page)]
    printed = "\n".join(run_plan(command, tmp_path)[1] for command in dict.fromkeys(commands))
    stray = sorted({figure for figure in FIGURE.findall(page) if figure not in printed})
    assert not stray, f"figures on docs/SCALE.md that none of its `puzzle plan` commands prints: {stray}"


def rewrite_tables(text: str, tmp_path: Path) -> str:
    """`text` with every plan table (its exit code, usable-memory line and rows) replaced by its command's
    output now: `python tests/test_docs_plan.py` rewrites docs/SCALE.md so; excerpts and prose are by hand."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = HEADING.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        code, printed = run_plan(match["command"], tmp_path, as_json=True)
        plan = json.loads(printed)
        out += [f"### {match['title']}: `{match['command']}` (exit {code})", ""]
        out += [f"Usable memory per rank: {_gib(plan['memory_limit_bytes'])}.", "", *table_for(plan)]
        i += 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(("|", "Usable memory"))):
            i += 1
        out.append("")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        SCALE.write_text(rewrite_tables(SCALE.read_text(), Path(folder)))
