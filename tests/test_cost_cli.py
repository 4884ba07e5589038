"""`puzzle costs`: presets, config.json files (incl. nemotron_h_puzzle block_configs), checkpoint dirs, errors,
number syntax, help text."""

from __future__ import annotations

import argparse
import json

import pytest

from puzzle import nemotron_h
from puzzle.cli import build_parser, main
from puzzle.cost.analytic import model_active_params, model_params
from puzzle.presets import puzzle_75b_a9b_like, tiny_hybrid


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["costs", *argv])
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_preset_json(capsys):
    code, out, _ = run(capsys, "nemotron3-super", "--recipe", "nvfp4", "--kv-dtype", "fp8", "--json")
    assert code == 0
    costs = json.loads(out)
    assert costs["total_params"] == 120_668_687_360
    assert costs["active_params"] == 12_770_216_960
    assert costs["weight_bytes"] == pytest.approx(69.544e9, rel=1e-4)
    assert costs["state_bytes_per_request"] == 4096 * 1_000_000 + 170_229_760
    assert costs["max_concurrent_requests"] == 1
    assert costs["by_kind"]["moe"]["blocks"] == 40


def test_preset_table(capsys):
    code, out, _ = run(capsys, "nemotron3-nano", "--hardware", "h200", "--context", "128000")
    assert code == 0
    assert "| mamba | 23 |" in out and "| attention | 6 |" in out
    assert "| parameters | 31,577,937,344 |" in out


def test_puzzle_config_json_and_checkpoint_dir(capsys, tmp_path):
    spec = puzzle_75b_a9b_like()
    config = nemotron_h.config_from_spec(spec)
    assert config["model_type"] == "nemotron_h_puzzle" and "block_configs" in config
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for target in (str(path), str(tmp_path)):
        code, out, _ = run(capsys, target, "--json")
        assert code == 0
        costs = json.loads(out)
        assert costs["total_params"] == model_params(spec)
        assert costs["active_params"] == model_active_params(spec)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nemotron9"], "unknown preset 'nemotron9'"),
        (["tiny-hybrid", "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
        (["tiny-hybrid", "--recipe", "int2"], "unknown quantisation recipe 'int2'"),
        (["tiny-hybrid", "--context", "0"], "argument --context: expected a positive whole number"),
        (
            ["tiny-hybrid", "--context", "1.5"],
            "expected a whole number such as 1000000, 1e6 or 1M, found '1.5'",
        ),
        (["tiny-hybrid", "--context", "0.5x"], "expected an absolute number"),
        (["tiny-hybrid", "--context", "1e999"], "expected a finite number"),
        (["tiny-hybrid", "--memory-fraction", "1.1"], "expected a fraction in (0, 1]"),
        (["tiny-hybrid", "--memory-fraction", "nan"], "expected a finite number"),
        (["missing/config.json"], "does not exist"),
        (["/dev/null"], "/dev/null is neither a config.json file nor a checkpoint directory"),
        (
            ["tiny-hybrid", "--scenario", "chat:prompt=16,generated=4"],
            "--scenario is only used with --user-speed",
        ),
        (["tiny-hybrid", "--compute-dtype", "fp8"], "--compute-dtype is only used with --user-speed"),
        (["tiny-hybrid", "--user-speed", "10", "--scenario", "abc"], "abc"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err


def test_malformed_configs(capsys, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    code, _, err = run(capsys, str(broken))
    assert code == 2 and "not valid JSON" in err

    config = nemotron_h.config_from_spec(tiny_hybrid())
    config["model_type"] = "llama"
    wrong = tmp_path / "llama.json"
    wrong.write_text(json.dumps(config))
    code, _, err = run(capsys, str(wrong))
    assert code == 2 and "unsupported model_type 'llama'" in err

    config = nemotron_h.config_from_spec(puzzle_75b_a9b_like())
    config["block_configs"] = config["block_configs"][:-1]
    short = tmp_path / "short.json"
    short.write_text(json.dumps(config))
    code, _, err = run(capsys, str(short))
    assert code == 2 and "block_configs has 87 entries" in err


@pytest.mark.parametrize(("context", "tokens"), [("1e6", 1_000_000), ("1M", 1_000_000), ("128k", 128_000)])
def test_context_takes_the_budget_number_syntax_and_stays_an_integer(capsys, context, tokens):
    code, out, err = run(
        capsys, "nemotron3-nano", "--context", context, "--memory-fraction", "9e-1", "--json"
    )
    assert code == 0, err
    costs = json.loads(out)
    assert costs["context"] == tokens and isinstance(costs["context"], int)
    assert costs["memory_fraction"] == 0.9
    code, plain, _ = run(capsys, "nemotron3-nano", "--context", str(tokens), "--json")
    assert json.loads(plain) == costs


def test_byte_counts_are_integers(capsys):
    # nvfp4 packs two values per byte: sums of half bytes, rounded up to whole ones.
    code, out, _ = run(capsys, "nemotron3-super", "--recipe", "nvfp4", "--json")
    assert code == 0
    costs = json.loads(out)
    assert isinstance(costs["weight_bytes"], int) and costs["weight_bytes"] == pytest.approx(
        69.544e9, rel=1e-4
    )
    assert all(isinstance(row["weight_bytes"], int) for row in costs["by_kind"].values())
    assert sum(row["weight_bytes"] for row in costs["by_kind"].values()) - costs["weight_bytes"] in range(
        len(costs["by_kind"])
    )
    assert isinstance(costs["usable_memory_bytes"], int)


def test_zero_concurrency_says_why(capsys):
    # bf16 Super (241.5 GB of weights) on one H100: the weights alone exceed 0.9 x 85.5 GB.
    code, out, _ = run(capsys, "nemotron3-super")
    assert code == 0
    assert (
        "| max concurrent requests | 0: the weights alone (241.505 GB) do not fit in the usable 76.969 GB |"
        in out
    )
    code, out, _ = run(capsys, "nemotron3-super", "--json")
    costs = json.loads(out)
    assert costs["max_concurrent_requests"] == 0 and costs["weights_fit"] is False
    assert costs["weight_bytes"] > costs["usable_memory_bytes"] == int(0.9 * costs["hardware_memory_bytes"])
    # nvfp4 weights fit, but not one request of 100M tokens.
    code, out, _ = run(capsys, "nemotron3-super", "--recipe", "nvfp4", "--context", "1e8")
    assert "| max concurrent requests | 0: one request (819.370 GB) does not fit in the 7.424 GB left" in out
    code, out, _ = run(capsys, "nemotron3-super", "--recipe", "nvfp4", "--json")
    assert json.loads(out)["weights_fit"] is True


def test_help_gives_every_default_and_unit():
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    costs = subparsers.choices["costs"]
    helps = {}
    for action in costs._actions:
        if action.option_strings and action.nargs != 0 and action.default is not argparse.SUPPRESS:
            text = costs._get_formatter()._expand_help(action)
            helps[action.dest] = text
            assert f"default {action.default}" in text, (action.dest, text)
    assert set(helps) == {
        "hardware",
        "context",
        "recipe",
        "kv_dtype",
        "ssm_dtype",
        "memory_fraction",
        "user_speed",
        "scenario",
        "compute_dtype",
    }
    assert "tokens" in helps["context"]
    for dtype in ("kv_dtype", "ssm_dtype"):
        assert "bytes per value: fp32 4, bf16 2, fp16 2, fp8 1" in helps[dtype]
    assert "(0, 1]" in helps["memory_fraction"]
