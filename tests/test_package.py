"""The package surface: every advertised name resolves, the README's `puzzle.X...` chains resolve after
`import puzzle`, `dir()` lists exports and subpackages, the CLI lists its commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import puzzle
from puzzle.cli import main


def test_every_export_resolves() -> None:
    missing = [name for name in puzzle.__all__ if getattr(puzzle, name, None) is None]
    assert missing == []


def test_cli_lists_its_commands(capsys) -> None:
    assert main([]) == 2  # no command: the help, as a usage error (tests/test_cli_errors.py)
    err = capsys.readouterr().err
    assert "costs" in err and "search" in err


def test_python_dash_m_puzzle_runs_a_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "puzzle", "costs", "nemotron3-nano", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert '"total_params": 31577937344' in result.stdout


# `puzzle.<name>...` chains the README writes, in code blocks and inline code; file names like
# `puzzle.json` (an export's record) are not attributes.
_README = Path(__file__).resolve().parents[1] / "README.md"
_CHAIN = re.compile(r"(?<![\w./-])puzzle(?:\.[A-Za-z_]\w*)+")
_FILE_SUFFIXES = {"json", "yaml", "yml", "md", "py", "safetensors"}


def _readme_chains() -> list[str]:
    text = _README.read_text()
    code = re.findall(r"```[^\n]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    chains = {chain for snippet in code for chain in _CHAIN.findall(snippet)}
    return sorted(chain for chain in chains if chain.rsplit(".", 1)[1] not in _FILE_SUFFIXES)


def _fresh_python(code: str) -> str:
    """Run `code` in a new interpreter (nothing imported yet, as in a notebook) and return its stdout."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_readme_attribute_chain_resolves_after_import_puzzle() -> None:
    chains = _readme_chains()
    assert "puzzle.presets.get_space_preset" in chains and len(chains) > 20  # the extraction found them
    code = textwrap.dedent(
        f"""
        import functools, json, puzzle
        failed = {{}}
        for chain in {chains!r}:
            try:
                functools.reduce(getattr, chain.split(".")[1:], puzzle)
            except AttributeError as error:
                failed[chain] = str(error)
        print(json.dumps(failed))
        """
    )
    assert json.loads(_fresh_python(code)) == {}


def test_dir_lists_exports_and_subpackages_without_importing_torch() -> None:
    code = "import json, sys, puzzle; print(json.dumps([dir(puzzle), 'torch' in sys.modules]))"
    names, torch_imported = json.loads(_fresh_python(code))
    assert set(puzzle.__all__) <= set(names)
    assert {"presets", "search", "nemotron_h", "bld", "cost", "model"} <= set(names)
    assert "Any" not in names and "__main__" not in names  # no stray import; never the CLI entry point
    assert not torch_imported  # `import puzzle` and completion stay light


def test_submodules_are_attributes_of_their_packages() -> None:
    code = textwrap.dedent(
        """
        import json, puzzle
        print(json.dumps([
            "budget" in dir(puzzle.search), "tensors" in dir(puzzle.blocks), "remote" in dir(puzzle.nemotron_h),
            puzzle.cost.measure.__name__, puzzle.demo.pipeline.__name__,
        ]))
        """
    )
    assert json.loads(_fresh_python(code)) == [
        True,
        True,
        True,
        "puzzle.cost.measure",
        "puzzle.demo.pipeline",
    ]
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        puzzle.no_such_module  # noqa: B018


def test_ci_runs_the_readme_test_command_verbatim_with_the_eval_extra() -> None:
    """.ci/run's last line is the README's test command byte for byte, and both install `[eval]`, so that
    CI runs tests/test_eval.py (it skips without lm-eval)."""
    root = Path(__file__).resolve().parents[1]
    readme_commands = re.findall(r"```bash\n([^\n]*python -m pytest[^\n]*)\n```", _README.read_text())
    ci_lines = [line for line in (root / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert len(readme_commands) == 1, readme_commands
    assert ci_lines[-1] == readme_commands[0]
    assert "'.[dev,eval]'" in readme_commands[0]
