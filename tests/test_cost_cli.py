"""`puzzle costs`: presets, config.json files (incl. nemotron_h_puzzle block_configs), checkpoint dirs, errors."""

from __future__ import annotations

import json

import pytest

from puzzle import hf
from puzzle.cli import main
from puzzle.cost.analytic import model_active_params, model_params
from puzzle.presets import puzzle_75b_a9b_like, tiny_hybrid


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["costs", *argv])
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
    config = hf.config_from_spec(spec)
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
        (["tiny-hybrid", "--context", "0"], "--context must be a positive"),
        (["missing/config.json"], "does not exist"),
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

    config = hf.config_from_spec(tiny_hybrid())
    config["model_type"] = "llama"
    wrong = tmp_path / "llama.json"
    wrong.write_text(json.dumps(config))
    code, _, err = run(capsys, str(wrong))
    assert code == 2 and "unsupported model_type 'llama'" in err

    config = hf.config_from_spec(puzzle_75b_a9b_like())
    config["block_configs"] = config["block_configs"][:-1]
    short = tmp_path / "short.json"
    short.write_text(json.dumps(config))
    code, _, err = run(capsys, str(short))
    assert code == 2 and "block_configs has 87 entries" in err
