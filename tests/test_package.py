"""The package surface: every advertised name resolves, the CLI lists its commands."""

from __future__ import annotations

import subprocess
import sys

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
