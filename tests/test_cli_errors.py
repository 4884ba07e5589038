"""The `puzzle` command on bad input: a one-line error and exit code 1 or 2, never a traceback.

Every sub-command registered in puzzle/cli.py is found from the parser, and every argument it takes is
given every bad value below (missing files, directories, corrupt files, nonsense numbers, unwritable
paths...), so that a new sub-command or option is covered without editing this file. Also: output cut
short by a closed pipe (`| head -1`), `--version`, bare `puzzle`, and the safety net in `main`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import puzzle
from puzzle import cli, nemotron_h
from puzzle.presets import tiny_hybrid

# name -> the value, "@name" standing for a file made by `bad_files` under a temporary directory.
BAD_VALUES = {
    "nonsense": "abc",
    "empty": "",
    "negative": "-1",
    "zero": "0",
    "fraction": "1.5",
    "huge": "1e999",
    "nan": "nan",
    "factor": "0.6x",
    "unknown-preset": "nemotron9",
    "missing-file": "@missing.json",
    "directory": "@directory",
    "corrupt-json": "@corrupt.json",
    "empty-file": "@empty.json",
    "binary-file": "@binary.json",
    "json-list": "@list.json",
    "corrupt-config-checkpoint": "@corrupt-checkpoint",
    "checkpoint-without-weights": "@config-only-checkpoint",
    "unwritable-path": "@a-file/out",  # under a regular file: unwritable even for root
}

# A valid command line per sub-command (files as above), so that each bad value meets the code that
# reads that argument rather than argparse's "required". A sub-command without one is still run with
# every bad value, and must still never print a traceback, but exit 0 is then allowed (its valid
# values are unknown here).
BASELINES: dict[str, list[str]] = {
    "costs": ["tiny-hybrid"],
    "search": ["--library", "@library.json"],
    "config check": ["@run-config.yaml"],
    "report": ["@run", "--out", "@report-out"],  # the run_dir fixture's run (a library, no solution)
    "convert": ["@parent", "@convert-out", "--max-shard-size", "1MB"],
    "demo": ["--dry-run", "--out", "@demo-out", "--cache", "@demo-cache"],  # checks, then stops
}
# Arguments a command writes to: each case gets its own copy of the bad file it names (and runs in its
# own directory), so that a legitimate write never changes a file that later cases read.
OUTPUTS = {("report", "out"), ("convert", "dst"), ("demo", "out"), ("demo", "cache")}
_WRITABLE = {"nonsense", "negative", "zero", "fraction", "huge", "nan", "factor", "unknown-preset"}

# (sub-command, argument dest) -> bad-value names it legitimately accepts (exit 0).
ACCEPTED: dict[tuple[str, str], set[str]] = {
    ("costs", "target"): {"checkpoint-without-weights"},  # costs need the config only
    ("search", "same"): set(BAD_VALUES),  # "missing or null = free": any key is allowed
    ("search", "keep_block"): {"zero"},  # layer 0 exists
    ("search", "time_limit"): {"fraction"},  # 1.5 seconds
    ("search", "gap"): {"zero", "fraction"},  # an exact optimum; any relative gap
    ("search", "frontier"): set(BAD_VALUES),  # only written with --sweep: see the case below
    # A plain name is a fine output directory (written into the case's own directory), as are a missing
    # path and an empty directory; convert also replaces an earlier (even broken) checkpoint.
    ("report", "out"): _WRITABLE | {"missing-file", "directory"},
    ("convert", "dst"): _WRITABLE
    | {"missing-file", "directory", "corrupt-config-checkpoint", "checkpoint-without-weights"},
    ("convert", "max_shard_size"): {"fraction"},  # 1 byte: one tensor per shard
    ("costs", "user_speed"): {"fraction"},  # 1.5 tokens/s per user: a (slow) speed
    # A new or empty run directory; any directory as the cache (it only adds demo-* folders to it).
    ("demo", "out"): _WRITABLE | {"missing-file", "directory"},
    ("demo", "cache"): _WRITABLE
    | {"missing-file", "directory", "corrupt-config-checkpoint", "checkpoint-without-weights"},
    ("demo", "seed"): {"zero"},
}

# Cases that fail because of search-specific code (puzzle/commands/search.py, puzzle/search_*.py), to be
# fixed on the `search` branch: (sub-command, argument dest, bad-value name) -> what goes wrong.


def _library() -> dict:
    """A 3-layer library in NVlabs' block_library.json shape."""
    layers = {}
    for layer in range(3):
        layers[f"layer_{layer}"] = {
            f"ffn {width}%": {
                "stats": {"memory_mib": 10.0 * width, "num_params": 1000 * width},
                "metrics": {"kl_div": 0.0 if width == 100 else (100 - width) / 100},
            }
            for width in (100, 50, 25)
        }
    return layers


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    """A directory holding every file a bad value or a baseline names."""
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "directory").mkdir()
    (root / "corrupt.json").write_text("{not json")
    (root / "empty.json").write_text("")
    (root / "binary.json").write_bytes(bytes(range(256)))
    (root / "list.json").write_text("[1, 2]")
    (root / "a-file").write_text("a regular file")
    (root / "corrupt-checkpoint").mkdir()
    (root / "corrupt-checkpoint" / nemotron_h.CONFIG_NAME).write_text('{"model_type": "nemotron_h", ')
    (root / "config-only-checkpoint").mkdir()
    (root / "config-only-checkpoint" / nemotron_h.CONFIG_NAME).write_text(
        json.dumps(nemotron_h.config_from_spec(tiny_hybrid()))
    )
    (root / "library.json").write_text(json.dumps(_library()))
    _write_run_config(root)
    return root


def _write_run_config(root: Path) -> None:
    """A run config whose parent is a real (tiny, random) checkpoint with a tokenizer and a text file of data."""
    import torch

    from puzzle.model import HybridLM

    torch.manual_seed(0)
    nemotron_h.save_pretrained(HybridLM(tiny_hybrid(hidden_size=32, vocab_size=64)), root / "parent")
    (root / "parent" / "tokenizer.json").write_text("{}")  # only its presence is checked
    (root / "data").mkdir()
    (root / "data" / "corpus.txt").write_text("a document\n\nanother document\n")
    (root / "run-config.yaml").write_text(
        "run_dir: run\nparent: {path: parent}\ndata: {sources: [data/corpus.txt], seq_len: 8}\n"
        "space: {kinds: {mlp: {width_fraction: [0.5]}}}\nsearch: {budgets: ['params<=0.95x']}\n"
    )


def _resolve(argv: list[str], root: Path) -> list[str]:
    return [str(root / arg[1:]) if arg.startswith("@") else arg for arg in argv]


@functools.cache
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every sub-command by its words ("costs", "config check"), nested ones included."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found[f"{prefix}{name}"] = child
                    walk(child, f"{prefix}{name} ")

    walk(cli.build_parser(), "")
    return found


def _slots(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments of a sub-command that take a value (positionals and options; not flags or --help)."""
    return [
        action
        for action in parser._actions
        if action.nargs != 0 and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
    ]


def _with_value(
    command: str, action: argparse.Action, value: str, baseline: list[str] | None = None
) -> list[str]:
    """The baseline of `command` (or `baseline`) with `action` given `value` (a positional replaced or
    added, an option added)."""
    baseline = list(BASELINES.get(command, []) if baseline is None else baseline)
    if action.option_strings:
        option = action.option_strings[-1]
        if option in baseline:  # replace the baseline's own value for it
            index = baseline.index(option)
            del baseline[index : index + 2]
        return [*command.split(), *baseline, option, value]
    positionals = [a.dest for a in _subcommands()[command]._actions if not a.option_strings]
    position = positionals.index(action.dest)
    values = list(itertools.takewhile(lambda arg: not arg.startswith("-"), baseline))  # positionals first
    given = len(values)
    values[position : position + 1] = [value]
    return [*command.split(), *values, *baseline[given:]]


def _cases() -> list:
    cases = []
    for command, parser in _subcommands().items():
        for action in _slots(parser):
            for name, value in BAD_VALUES.items():
                cases.append(
                    pytest.param(command, action.dest, name, value, id=f"{command}-{action.dest}-{name}")
                )
    return cases


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) in this process: (exit code, stdout, stderr); argparse's SystemExit gives its code."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_clean_failure(code: int, err: str, argv: list[str]) -> None:
    assert "Traceback" not in err, (argv, err)
    assert "unexpected error" not in err, (argv, err)  # main's safety net: a cause left unhandled
    assert code in (1, 2), (argv, code, err)
    assert err.strip(), (argv, "exit code without a message")


def test_every_baseline_runs(capsys, bad_files, run_dir):
    """The bad values below are tried against command lines that work."""
    for command, baseline in BASELINES.items():
        assert command in _subcommands()
        code, out, err = run_cli([*command.split(), *_resolve(baseline, bad_files)], capsys)
        assert code == 0, (command, err)
        assert out


@pytest.mark.parametrize(("command", "dest", "name", "value"), _cases())
def test_bad_argument_is_a_clean_error(
    capsys, bad_files, run_dir, tmp_path, monkeypatch, command, dest, name, value
):
    action = next(a for a in _slots(_subcommands()[command]) if a.dest == dest)
    if (command, dest) in OUTPUTS:
        monkeypatch.chdir(tmp_path)
        if value.startswith("@"):
            own = value[1:].split("/")[0]
            if (bad_files / own).is_dir():
                shutil.copytree(bad_files / own, tmp_path / own)
            elif (bad_files / own).exists():
                shutil.copy(bad_files / own, tmp_path / own)
            value = str(tmp_path / value[1:])
    argv = _resolve(_with_value(command, action, value), bad_files)
    code, _, err = run_cli(argv, capsys)
    assert "Traceback" not in err, (argv, err)
    assert "unexpected error" not in err, (argv, err)
    if code == 0 and (name in ACCEPTED.get((command, dest), ()) or command not in BASELINES):
        return
    _assert_clean_failure(code, err, argv)


# `puzzle search RUN_DIR`: every argument of `search` given every bad value on a run directory's command
# line (on the --library baseline above, the run-only options are refused before anything is read).
RUN_DIR_BASELINE = [
    "@run",
    "--scenario",
    "chat:batch=2,prompt=16,generated=4",
    "--budget",
    "throughput[chat]>=1.1x",
]
RUN_DIR_ACCEPTED: dict[str, set[str]] = {
    "keep_block": {"zero"},  # block 0 exists
    "time_limit": {"fraction"},
    "gap": {"zero"},
    "rerank": {"zero"},  # 0 = off
    # A plain file name is a fine --out (written into the test's own working directory).
    "out": {"nonsense", "negative", "zero", "fraction", "huge", "nan", "factor", "unknown-preset"},
}
# --out is only given the bad files it must refuse: it would overwrite the others, which later cases read.
_OUT_FILES = {"directory", "unwritable-path"}


@pytest.fixture(scope="module")
def run_dir(bad_files) -> Path:
    """A tiny real run (parent.json, a BLD library, its scores) as bad_files/run."""
    from rundir_helpers import make_run

    return make_run(bad_files / "run", failures=False, bld_steps=1).root


def _run_dir_cases() -> list:
    cases = []
    for action in _slots(_subcommands()["search"]):
        for name, value in BAD_VALUES.items():
            if action.dest == "out" and value.startswith("@") and name not in _OUT_FILES:
                continue
            cases.append(pytest.param(action.dest, name, value, id=f"search-RUN_DIR-{action.dest}-{name}"))
    return cases


def test_the_run_dir_baseline_runs(capsys, bad_files, run_dir):
    code, out, err = run_cli(["search", *_resolve(RUN_DIR_BASELINE, bad_files)], capsys)
    assert code == 0 and "block_0" in out, err


@pytest.mark.parametrize(("dest", "name", "value"), _run_dir_cases())
def test_bad_argument_to_a_run_dir_search_is_a_clean_error(
    capsys, bad_files, run_dir, tmp_path, monkeypatch, dest, name, value
):
    monkeypatch.chdir(tmp_path)
    action = next(a for a in _slots(_subcommands()["search"]) if a.dest == dest)
    argv = _resolve(_with_value("search", action, value, RUN_DIR_BASELINE), bad_files)
    code, _, err = run_cli(argv, capsys)
    if code == 0 and name in RUN_DIR_ACCEPTED.get(dest, ()):
        return
    _assert_clean_failure(code, err, argv)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["costs", "/dev/null"], id="costs-device-file"),
        pytest.param(["costs", "@directory/config.json"], id="costs-missing-config-in-dir"),
        pytest.param(
            ["costs", "tiny-hybrid", "--context", "1e6", "--memory-fraction", "1e999"], id="costs-inf"
        ),
        pytest.param(
            [
                "search",
                "--library",
                "@library.json",
                "--sweep",
                "stats.memory_mib<=20,25",
                "--frontier",
                "@a-file/f",
            ],
            id="search-frontier-unwritable",
        ),
        pytest.param(["search", "--library", "@config-only-checkpoint"], id="search-library-is-a-checkpoint"),
        pytest.param(
            ["search", "--library", "@config-only-checkpoint/config.json"], id="search-library-is-a-config"
        ),
    ],
)
def test_more_bad_command_lines(capsys, bad_files, argv):
    argv = _resolve(argv, bad_files)
    code, _, err = run_cli(argv, capsys)
    _assert_clean_failure(code, err, argv)


def test_output_into_a_closed_pipe_exits_quietly():
    """`puzzle costs nemotron3-super | head -c 1`: the reader takes the start (or nothing) and closes."""
    reader, writer = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "puzzle", "costs", "nemotron3-super"],
        stdout=writer,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        pipe.read(1)
    _, err = process.communicate(timeout=300)
    assert err == ""  # not "BrokenPipeError", not "Exception ignored"
    assert process.returncode in (0, cli.EXIT_BROKEN_PIPE)  # 0 when all of it fitted the pipe in time


def test_output_into_a_pipe_closed_before_any_write():
    """The reader has closed before the child writes: every write fails, deterministically."""
    reader, writer = os.pipe()
    os.close(reader)
    process = subprocess.Popen(
        [sys.executable, "-m", "puzzle", "costs", "nemotron3-super", "--json"],
        stdout=writer,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(writer)
    _, err = process.communicate(timeout=300)
    assert err == ""
    assert process.returncode == cli.EXIT_BROKEN_PIPE == 141


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_to_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "puzzle", "costs", "tiny-hybrid", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    assert "No space left on device" in result.stderr and result.stderr.count("\n") == 1


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"puzzle {puzzle.__version__}\n"
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'version = "{puzzle.__version__}"' in pyproject


def test_bare_puzzle_is_a_usage_error_with_the_help(capsys):
    code, out, err = run_cli([], capsys)
    assert code == 2  # as argparse's other usage errors
    assert out == ""
    assert err.startswith("usage: puzzle") and all(command.split()[0] in err for command in _subcommands())


def _a_bug(args: argparse.Namespace) -> int:
    """A sub-command with a defect: an exception none of the checks expected."""
    return {}["missing"]


def test_safety_net_turns_an_unexpected_exception_into_one_line(capsys, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    args = argparse.Namespace(command="demo", func=_a_bug)
    assert cli.run_command(args) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "puzzle demo: unexpected error: KeyError: 'missing'",
        f"puzzle demo: rerun with {cli.DEBUG_ENV}=1 to see the traceback",
    ]
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(KeyError):
        cli.run_command(args)
