"""The run config: strict loading (unknown keys, types, impossible values, missing keys, YAML errors, each
with its key path and line), budgets, the path checks against a real tiny checkpoint, `puzzle config`'s
exit codes, round trips, the example configs and the generated reference page."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest
import torch
import yaml
from safetensors.torch import save_file

from puzzle import cli, nemotron_h
from puzzle.config import (
    ConfigError,
    RunConfig,
    dump_config,
    from_data,
    load_config,
    load_config_data,
    reference_markdown,
    to_dict,
)
from puzzle.config.loader import type_hints
from puzzle.cost.limits import Relative
from puzzle.data import TokenData
from puzzle.model import HybridLM
from puzzle.presets import nemotron3_nano, tiny_hybrid
from puzzle.presets.demo import demo_parent_spec
from puzzle.search.budget import DeploymentLimit
from puzzle.search.budget import parse_budget as search_parse_budget

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "configs"
# Every run config the examples hold: examples/configs/*.yaml and the seed's run, examples/nemotron3_super/.
EXAMPLE_CONFIGS = [*sorted(EXAMPLES.glob("*.yaml")), ROOT / "examples" / "nemotron3_super" / "config.yaml"]

BASE = {
    "run_dir": "runs/x",
    "parent": {"path": "/models/parent"},
    "data": {"sources": ["corpus.txt"]},
    "space": {"kinds": {"mlp": {"width_fraction": [0.5]}}},
    "search": {"budgets": ["active_params<=0.6x", "throughput[chat]>=1.5x"]},
    "hardware": {"scenarios": {"chat": {"batch_size": 8, "prompt_tokens": 1024, "generated_tokens": 256}}},
}


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config_data(data)
    return str(caught.value)


def with_value(path: str, value) -> dict:
    """BASE with `value` at dotted `path` (sections created as needed)."""
    data = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = data
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    return data


# ----------------------------------------------------------------------------------------------------------
# Unknown keys, types, values, missing keys.


def _sections(cls=RunConfig, prefix="") -> list[tuple[str, type]]:
    """(dotted path, dataclass) of every section, nested ones included; `NAME` entries under 'chat'."""
    out = [(prefix, cls)]
    hints = type_hints(cls)
    for item in dataclasses.fields(cls):
        tp = hints[item.name]
        path = f"{prefix}.{item.name}" if prefix else item.name
        if typing.get_origin(tp) is dict:
            tp, path = typing.get_args(tp)[1], f"{path}.chat"
        if dataclasses.is_dataclass(tp) and item.name != "space":
            out += _sections(tp, path)
    return out


@pytest.mark.parametrize(("path", "cls"), _sections(), ids=lambda x: x if isinstance(x, str) else "")
def test_unknown_key_at_every_level_names_it_and_lists_the_valid_keys(path, cls):
    data = copy.deepcopy(BASE)
    node = data
    for name in path.split(".") if path else []:
        node = node.setdefault(name, {})
    if cls.__name__ == "Scenario":
        node.update(batch_size=1, prompt_tokens=1, generated_tokens=1)
    node["bogus_key"] = 1
    message = error_of(data)
    key = f"{path}.bogus_key" if path else "bogus_key"
    assert message.startswith(f"{key}: unknown key"), message
    valid = message.split("valid keys", 1)[1]
    assert all(f.name in valid for f in dataclasses.fields(cls)), message


def test_unknown_key_in_the_inline_space_and_a_did_you_mean():
    assert "space.kinds.moe: unknown key(s) ['topk']" in error_of(
        with_value("space", {"kinds": {"moe": {"topk": 2}}})
    )
    message = error_of(with_value("bld.lrr", 1e-3))
    assert message.startswith("bld.lrr: unknown key; did you mean 'lr'? valid keys in bld: lr, warmup_tokens")
    assert "did you mean 'bld'?" in error_of(with_value("blld", {}))


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("data.seq_len", "4096", "data.seq_len: expected an integer, got the string '4096'"),
        ("bld.lr", "1e-4", "bld.lr: expected a number, got the string '1e-4'"),
        ("bld.warmup_tokens", True, "bld.warmup_tokens: expected an integer, got true"),
        ("bld.token_budget", 1.5, "bld.token_budget: expected an integer, got 1.5"),
        ("importance.linear_fit", 1, "importance.linear_fit: expected true or false, got 1"),
        ("parent.path", 5, "parent.path: expected a path (a non-empty string), got 5"),
        ("search.budgets", "params<=1e9", "search.budgets: expected a list (each a string), got the string"),
        ("bld.betas", [0.9], "bld.betas: expected a list of 2 items (a number, a number), got 1 item(s)"),
        ("parent.dtype", "bf16", "parent.dtype: expected one of 'auto', 'bfloat16', 'float16', 'float32', got "
         "the string 'bf16' (did you mean 'bfloat16'?)"),
        ("hardware.scenarios", [1], "hardware.scenarios: expected a mapping of names to a mapping"),
        ("gkd", 3, "gkd: expected a mapping with keys lr, min_lr_ratio"),
        ("space", 3, "space: expected a mapping (a SearchSpace section) or a string, got 3"),
        ("bld.memory_limit_bytes", float("nan"), "bld.memory_limit_bytes: expected an integer, got nan"),
        ("data.split_seed", None, "data.split_seed: expected an integer, got null"),
    ],
)  # fmt: skip
def test_wrong_type_names_the_key_and_what_was_expected(path, value, expected):
    assert error_of(with_value(path, value)).startswith(expected)


def test_numbers_read_as_numbers_and_nothing_else():
    config = load_config_data(
        with_value("bld", {"lr": 1, "token_budget": 2e6, "memory_limit_bytes": None, "betas": [0.9, 1]})
    )
    assert config.bld.lr == 1.0 and isinstance(config.bld.lr, float)  # an integer where a number goes
    assert config.bld.token_budget == 2_000_000 and isinstance(config.bld.token_budget, int)
    assert config.bld.betas == (0.9, 1.0)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("bld.lr", -1, "bld.lr: expected a positive number, got -1"),
        ("bld.clip", -1, "bld: clip >= 0 and 0 <= min_lr_ratio <= 1, found -1.0, 0.1"),
        ("bld.shard", "ddp", "bld.shard: expected 'fsdp', 'hsdp' or 'none', got 'ddp'"),
        ("scoring.vocab_chunk", 0, "scoring.vocab_chunk: expected a value >= 1, got 0"),
        ("search.solver.gap_rel", 2, "search.solver.gap_rel: expected a relative gap in [0, 1) such as 1e-6, got 2"),
        ("search.solver.solver", "gurobi", "search.solver: unknown solver 'gurobi'; choose one of auto, highs, cbc"),
        ("hardware.scenarios.chat.batch_size", 0, "hardware.scenarios.chat.batch_size: expected a positive integer, got 0"),
        ("hardware.scenarios.chat.kv_dtype", "int3", "hardware.scenarios.chat: unknown dtype 'int3'"),
        ("hardware.profile", "h1000", "hardware.profile: unknown hardware 'h1000'; choose one of"),
        ("hardware.recipe", "int2", "hardware.recipe: unknown quantisation recipe 'int2'"),
        ("hardware.memory_fraction", 1.5, "hardware.memory_fraction: expected a fraction in (0, 1], got 1.5"),
        ("gkd.lr", 0, "gkd.lr: expected a positive number, got 0"),
        ("gkd.micro_batch_size", 9, "gkd.micro_batch_size: expected at most batch_size (8), got 9"),
        ("data.held_out_fraction", 0, "data.held_out_fraction: expected a fraction in (0, 1), got 0.0"),
        ("data.sources", [], "data.sources: expected at least one data source"),
        ("importance.tokens", 0, "importance.tokens: expected a positive integer, got 0"),
        ("seed", -1, "seed: expected an integer >= 0, got -1"),
        ("space", {"kinds": {"moe": {"top_k": [0]}}}, "space.kinds.moe.top_k[0] must be a positive integer, found 0"),
        ("search.min_diff", 2, "search.min_diff: needs solutions > 1"),
        ("search.context_guard", 1, "search.context_guard: expected 0 (off) or a factor > 1, got 1.0"),
        ("search.context_guard", -2, "search.context_guard: expected 0 (off) or a factor > 1, got -2.0"),
        ("search.context_guard", float("inf"), "search.context_guard: expected a finite number, got inf"),
        ("rounds.count", 0, "rounds.count: expected a positive integer, got 0"),
        ("rounds.count", 2, "rounds.budgets: 2 rounds need budgets: one list of budgets per round"),
    ],
)  # fmt: skip
def test_impossible_value_names_the_key(path, value, expected):
    assert error_of(with_value(path, value)).startswith(expected)


@pytest.mark.parametrize(
    ("budgets", "expected"),
    [
        (["active_params<=0.6x", "throughput[chatt]>=2"], "search.budgets[1]: budget 'throughput[chatt]>=2' names "
         "scenario 'chatt', which is not defined (defined: chat); define it under hardware.scenarios"),
        (["activ_params<=0.6x"], "search.budgets[0]: budget 'activ_params<=0.6x': unknown key 'activ_params'; "
         "known keys: params, active_params,"),
        (["active_params>=0.6x"], "search.budgets[0]: budget 'active_params>=0.6x': active_params takes a bound "
         "active_params<=VALUE only"),
        (["1<=params<=3e9"], "search.budgets[0]: budget '1<=params<=3e9': params takes a bound params<=VALUE only"),
        (["params<=abc"], "search.budgets[0]: cannot read budget value 'abc'"),
        (["params<=-3"], "search.budgets[0]: budget 'params<=-3': the bound must be positive"),
        (["throughput>=3"], "search.budgets[0]: budget 'throughput>=3': throughput needs scenarios"),
        (["params[chat]<=3"], "search.budgets[0]: budget 'params[chat]<=3': params takes no scenario"),
        (["latency[chat,chat]<=3"], "search.budgets[0]: budget 'latency[chat,chat]<=3' names a scenario twice"),
        (["concurrent_requests[chat]>=0.5x"], "search.budgets[0]: budget 'concurrent_requests[chat]>=0.5x': "
         "concurrent_requests needs a whole number"),
        ([], "search.budgets: no budget: give search.budgets"),
    ],
)  # fmt: skip
def test_bad_budget_names_its_index(budgets, expected):
    assert error_of(with_value("search.budgets", budgets)).startswith(expected)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("run_dir", "run_dir: missing (required): expected a path"),
        ("parent.path", "parent.path: missing (required): expected a path"),
        ("hardware.scenarios.chat.prompt_tokens", "hardware.scenarios.chat.prompt_tokens: missing (required): "
         "expected an integer"),
        ("data", "data: missing (required): expected a mapping (a DataConfig section)"),
    ],
)  # fmt: skip
def test_missing_required_key(path, expected):
    data = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = data
    for name in parents:
        node = node[name]
    del node[last]
    assert error_of(data).startswith(expected)


# ----------------------------------------------------------------------------------------------------------
# Budgets, rounds, seeds.


def test_budgets_and_the_cost_model_for_the_search():
    config = load_config_data(with_value("hardware.profile", "H100"))
    assert config.round_budgets() == [["active_params<=0.6x", "throughput[chat]>=1.5x"]]
    model = config.hardware  # the search's cost model itself
    assert model.profile == "h100-80gb" and model.recipe == "bf16" and model.memory_fraction == 0.9
    assert model.scenarios["chat"].name == "chat" and model.scenarios["chat"].batch_size == 8


def test_budgets_are_read_once_into_the_objects_the_search_takes():
    """The config reads each budget with the search's parser, against its own cost model, and hands on
    those objects: the texts, the parsed values and the sweep points all come from them."""
    data = with_value(
        "search", {"sweep": "active_params<=0.5x,0.7x", "budgets": ["params<=20G", "throughput[chat]>=1.5x"]}
    )
    data["hardware"] = {
        "scenarios": {"chat": {"batch_size": 8, "prompt_tokens": 512, "generated_tokens": 64}}
    }
    config = load_config_data(data)
    solves = config.round_limits()
    assert [[limit.text for limit in solve] for solve in solves] == config.round_budgets()
    assert all(isinstance(limit, DeploymentLimit) for solve in solves for limit in solve)
    assert solves[0][1] == search_parse_budget("throughput[chat]>=1.5x", config.hardware)
    assert (solves[0][1].key, solves[0][1].scenarios, solves[0][0].value) == ("throughput", ("chat",), 20e9)
    assert solves[0][0] is config.round_limits()[0][0]  # read once, not again per call
    assert solves[1][2].value == Relative(0.7)


def test_a_sweep_is_one_budget_list_per_value_and_the_other_budgets_hold():
    data = with_value(
        "search", {"sweep": "active_params<=0.5x,0.7x", "budgets": ["params<=20G", "active_params<=0.9x"]}
    )
    assert load_config_data(data).round_budgets() == [
        ["params<=20G", "active_params<=0.5x"],
        ["params<=20G", "active_params<=0.7x"],
    ]
    throughput = with_value("search", {"sweep": "throughput[chat]>=1.2x,1.5x"})
    assert load_config_data(throughput).round_budgets()[1] == ["throughput[chat]>=1.5x"]
    bad = with_value("search", {"sweep": "activ_params<=0.5x"})
    assert error_of(bad).startswith("search.sweep: budget 'activ_params<=0.5x': unknown key 'activ_params'")
    missing = with_value("search", {"sweep": "throughput[long]>=1.2x,1.5x"})
    assert error_of(missing).startswith("search.sweep: budget 'throughput[long]>=1.2x' names scenario 'long'")


def test_rounds_have_one_budget_list_each():
    data = with_value("rounds", {"count": 2, "budgets": [["active_params<=0.8x"], ["active_params<=0.75x"]]})
    del data["search"]
    config = load_config_data(data)
    assert [config.round_budgets(r) for r in (0, 1)] == [
        [["active_params<=0.8x"]],
        [["active_params<=0.75x"]],
    ]
    data["rounds"]["budgets"] = [["active_params<=0.8x"]]
    assert error_of(data).startswith("rounds.budgets: expected one list of budgets per round (2), got 1")
    data["rounds"]["budgets"] = [["active_params<=0.8x"], ["throughput[x]>=2"]]
    assert error_of(data).startswith("rounds.budgets[1][0]: budget 'throughput[x]>=2' names scenario 'x'")
    both = with_value("rounds", {"count": 1, "budgets": [["active_params<=0.8x"]]})
    assert error_of(both).startswith("rounds.budgets: give the budgets either per round")


def test_the_top_level_seed_is_the_default_of_the_stages_seeds():
    config = load_config_data(with_value("seed", 7))
    assert (config.bld.seed, config.gkd.seed) == (7, 7)
    data = with_value("seed", 7)
    data["bld"] = {"seed": 3}
    config = load_config_data(data)
    assert (config.bld.seed, config.gkd.seed) == (3, 7)
    assert load_config_data(config.to_dict()) == config


# ----------------------------------------------------------------------------------------------------------
# YAML files: syntax errors, lines, relative paths.


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BASE_YAML = yaml.safe_dump(BASE, sort_keys=False)


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "run_dir: runs/x\nparent:\n  path: [unclosed\ndata: {}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}, line 4") and "not valid YAML" in str(caught.value)


def test_a_key_given_twice_is_an_error_with_its_line(tmp_path):
    path = write(tmp_path, BASE_YAML + "seed: 1\nseed: 2\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    line = BASE_YAML.count("\n") + 2
    assert str(caught.value) == (
        f"{path}, line {line}: not valid YAML: key 'seed' given twice (first on line {line - 1})"
    )


def test_a_value_error_names_the_file_line_and_key(tmp_path):
    text = BASE_YAML + "bld:\n  warmup_tokens: 10\n  lr: -1\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    line = text.count("\n")
    assert str(caught.value) == f"{path}, line {line}: bld.lr: expected a positive number, got -1"
    assert caught.value.key == "bld.lr" and caught.value.line == line


def test_a_search_space_error_names_the_keys_own_line(tmp_path, parent_dir):
    """A typo (or a bad value) deep in the search space is reported at its own line, inline in the config
    or in a space file, not at the line of `space:`."""
    text = BASE_YAML.replace(
        "space:\n  kinds:\n    mlp:\n      width_fraction:", "space:\n  kinds:\n    mlp:\n      widht:"
    )
    assert "      widht:" in text
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    line = text.splitlines().index("      widht:") + 1
    assert str(caught.value).startswith(f"{path}, line {line}: space.kinds.mlp: unknown key(s) ['widht']")
    assert caught.value.key == "space"
    bad_value = text.replace("      widht:\n      - 0.5", "      width_fraction:\n      - 0.5\n      - 2")
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, bad_value))
    assert str(caught.value).startswith(f"{path}, line {line + 2}: space.kinds.mlp.width_fraction[1] must be")
    space = tmp_path / "space.yaml"
    space.write_text("rounding: 8\nkinds:\n  mlp:\n    width_fraction: [0.5]\n    rounding: 4\n    nope: 1\n")
    data = disk_config(tmp_path, parent_dir, space=str(space))
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, yaml.safe_dump(data)), check_paths=True)
    assert str(caught.value).startswith(f"{space}, line 6: space.kinds.mlp: unknown key(s) ['nope']")


def test_unreadable_files(tmp_path):
    cases = {
        "empty.yaml": b"",
        "list.yaml": b"[1, 2]\n",
        "binary.yaml": bytes(range(256)),
    }
    expected = {
        "empty.yaml": "the config is empty; expected a mapping with keys run_dir, parent",
        "list.yaml": "expected a mapping with keys run_dir, parent",
        "binary.yaml": "not a text file",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError) as caught:
            load_config(tmp_path / name)
        assert str(caught.value).startswith(f"{tmp_path / name}") and expected[name] in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read the config: No such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_yaml_numbers_are_yaml_1_2_numbers_and_quoted_ones_are_strings(tmp_path):
    config = load_config(write(tmp_path, BASE_YAML + "bld: {lr: 1e-4, token_budget: 2_000_000}\n"))
    assert config.bld.lr == 1e-4 and config.bld.token_budget == 2_000_000
    with pytest.raises(ConfigError, match=r"bld\.lr: expected a number, got the string '1e-4'"):
        load_config(write(tmp_path, BASE_YAML + "bld: {lr: '1e-4'}\n"))


def test_relative_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    config = load_config(write(tmp_path / "sub", BASE_YAML + "tokenizer: ~/tok\n"))
    assert config.run_dir == tmp_path / "sub" / "runs" / "x"
    assert config.data.sources == (tmp_path / "sub" / "corpus.txt",)
    assert config.parent.path == Path("/models/parent")
    assert config.tokenizer == Path.home() / "tok"


def test_a_space_file_is_relative_to_the_config_file_and_checked(tmp_path, parent_dir):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "space.yaml").write_text("kinds:\n  mlp: {width_fraction: [0.5, 0.25]}\n")
    data = disk_config(tmp_path, parent_dir, space="space.yaml")
    config = load_config(write(tmp_path / "sub", yaml.safe_dump(data)), check_paths=True)
    assert config.space == str(tmp_path / "sub" / "space.yaml")
    assert [v.spec.width for v in config.search_space().variants(tiny_hybrid(32, 64), 4)] == [128, 64, 32]
    (tmp_path / "sub" / "space.yaml").write_text("kinds:\n  mlp: {widht: [64]}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "sub" / "run.yaml", check_paths=True)
    assert str(caught.value).startswith(
        f"{tmp_path / 'sub' / 'space.yaml'}, line 2: space.kinds.mlp: unknown key(s) ['widht']"
    )


def test_round_trip_through_plain_data_and_yaml(tmp_path):
    config = load_config(write(tmp_path, BASE_YAML))
    assert load_config_data(config.to_dict()) == config
    assert load_config(write(tmp_path, dump_config(config), "resolved.yaml")) == config
    assert json.loads(json.dumps(config.to_dict())) == config.to_dict()


# ----------------------------------------------------------------------------------------------------------
# The generic loader on its own.


@dataclasses.dataclass(frozen=True)
class Inner:
    size: int
    mode: Literal["a", "b"] = "a"


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    pair: tuple[int, str] = (1, "x")
    named: dict[str, Inner] = dataclasses.field(default_factory=dict)
    where: Path | None = None
    ratio: float | None = None

    def __post_init__(self) -> None:
        if self.ratio is not None and self.ratio > 1:
            raise ValueError(f"Outer.ratio must be at most 1, found {self.ratio}")


def test_generic_loader(tmp_path):
    data = {"inner": {"size": 2}, "pair": [3, "y"], "named": {"k": {"size": 1, "mode": "b"}}, "where": "f"}
    loaded = from_data(Outer, data, base_dir=tmp_path)
    assert loaded == Outer(Inner(2), (3, "y"), {"k": Inner(1, "b")}, tmp_path / "f")
    assert from_data(Outer, to_dict(loaded)) == loaded
    with pytest.raises(ConfigError, match=r"^named\.k\.mode: expected one of 'a', 'b', got the string 'c'$"):
        from_data(Outer, {**data, "named": {"k": {"size": 1, "mode": "c"}}})
    with pytest.raises(ConfigError, match=r"^pair\[1\]: expected a string, got 3$"):
        from_data(Outer, {**data, "pair": [3, 3]})
    with pytest.raises(ConfigError, match=r"^ratio: expected at most 1, got 2$"):
        from_data(Outer, {**data, "ratio": 2})
    with pytest.raises(ConfigError, match=r"^inner\.size: missing \(required\): expected an integer$"):
        from_data(Outer, {"inner": {}})


# ----------------------------------------------------------------------------------------------------------
# Paths on disk, against a real tiny checkpoint.


@pytest.fixture(scope="module")
def parent_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parent")
    torch.manual_seed(0)
    nemotron_h.save_pretrained(HybridLM(tiny_hybrid(hidden_size=32, vocab_size=64)), root / "ckpt")
    (root / "ckpt" / "tokenizer.json").write_text("{}")
    return root / "ckpt"


def disk_config(tmp_path: Path, parent: Path, **changes) -> dict:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "corpus.txt").write_text("one document\n\nanother\n")
    data = copy.deepcopy(BASE)
    data.update(run_dir=str(tmp_path / "run"), parent={"path": str(parent)})
    data["data"] = {"sources": [str(tmp_path / "data" / "corpus.txt")], "seq_len": 8}
    data.update(changes)
    return data


def test_validate_paths_accepts_a_real_checkpoint(tmp_path, parent_dir):
    spec = load_config_data(disk_config(tmp_path, parent_dir)).validate_paths()
    assert spec == tiny_hybrid(hidden_size=32, vocab_size=64)


def test_validate_paths_errors(tmp_path, parent_dir):
    def problem(data: dict) -> str:
        with pytest.raises(ConfigError) as caught:
            load_config_data(data).validate_paths()
        return str(caught.value)

    missing = disk_config(tmp_path, tmp_path / "nowhere")
    assert problem(missing) == f"parent.path: checkpoint directory {tmp_path / 'nowhere'} does not exist"
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((parent_dir / "config.json").read_text())
    assert problem(disk_config(tmp_path, config_only)).startswith(
        f"parent.path: {config_only} has no safetensors weights"
    )
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((parent_dir / name).read_bytes())
    assert problem(disk_config(tmp_path, no_tokenizer)).startswith("parent.path: no tokenizer files in")
    inside = disk_config(tmp_path, parent_dir, run_dir=str(parent_dir / "run"))
    assert "run_dir: " in problem(inside) and "never written to" in problem(inside)
    too_wide = disk_config(tmp_path, parent_dir, space={"kinds": {"mlp": {"width": [100000]}}})
    assert problem(too_wide).startswith(
        "space: block 4 (mlp), axis width, value 100000: above the parent's 128"
    )
    no_data = disk_config(tmp_path, parent_dir)
    no_data["data"]["sources"] = [str(tmp_path / "absent.txt")]
    assert problem(no_data) == f"data.sources: data source {tmp_path / 'absent.txt'} does not exist"
    no_preset = disk_config(tmp_path, parent_dir, space="nemotron3-nano")
    assert problem(no_preset).startswith("space: 'nemotron3-nano' is neither a search space preset")
    keep = disk_config(tmp_path, parent_dir)
    keep["search"] = {**keep["search"], "keep_blocks": [9]}
    assert problem(keep) == "search.keep_blocks: blocks [9] do not exist: the parent has 6"


# ----------------------------------------------------------------------------------------------------------
# The command line.


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


FEASIBLE = {"budgets": ["params<=0.95x"]}  # met by a child of the tiny parent (the MLP at half width)


def test_config_check_prints_the_resolved_config(tmp_path, parent_dir, capsys):
    path = write(tmp_path, yaml.safe_dump(disk_config(tmp_path, parent_dir, search=FEASIBLE)))
    code, out, err = run_cli(["config", "check", str(path)], capsys)
    assert code == 0, err
    assert load_config_data(yaml.safe_load(out)) == load_config(path)
    assert err == f"{path}: valid (paths and budgets checked, the plan fits)\n"
    code, out, _ = run_cli(["config", "check", str(path), "--json"], capsys)
    assert code == 0 and json.loads(out) == load_config(path).to_dict()


@pytest.mark.parametrize(
    ("text", "flags", "expected"),
    [
        (BASE_YAML + "bld: {lr: -1}\n", ["--no-paths"], "bld.lr: expected a positive number, got -1"),
        (BASE_YAML + "blld: {}\n", ["--no-paths"], "blld: unknown key; did you mean 'bld'?"),
        ("run_dir: [\n", [], "not valid YAML"),
        (BASE_YAML, [], "parent.path: checkpoint directory /models/parent does not exist"),
    ],
)
def test_config_check_exits_2_with_one_line(tmp_path, capsys, text, flags, expected):
    path = write(tmp_path, text)
    code, out, err = run_cli(["config", "check", str(path), *flags], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"puzzle config check: error: {path}") and expected in err


def _broken_parent(tmp_path: Path, parent: Path, how: str) -> Path:
    """A copy of `parent` whose model.safetensors is cut short (`truncated`) or has no byte (`empty`)."""
    copy_dir = tmp_path / f"parent-{how}"
    shutil.copytree(parent, copy_dir)
    weights = copy_dir / "model.safetensors"
    content = weights.read_bytes()
    weights.write_bytes(content[: len(content) - 100] if how == "truncated" else b"")
    return copy_dir


def _bad_input(tmp_path: Path, parent: Path, case: str) -> tuple[dict, str]:
    """A run config with one bad input, and what its one-line error must say."""
    if case in ("truncated", "empty"):
        weights = _broken_parent(tmp_path, parent, case) / "model.safetensors"
        return disk_config(tmp_path, weights.parent), f"parent.path: safetensors file {weights} is {case}"
    if case == "unwritable":  # under a regular file: unwritable even for root
        above = tmp_path / "a-file"
        above.write_text("not a folder")
        config = disk_config(tmp_path, parent, run_dir=str(above / "run"))
        return config, f"run_dir: {above / 'run'} cannot be created: {above} is not a directory"
    if case == "truncated-data":  # a token file cut short
        config = disk_config(tmp_path, parent)
        tokens = tmp_path / "data" / "tokens.safetensors"
        save_file({"input_ids": torch.arange(64)}, str(tokens))
        tokens.write_bytes(tokens.read_bytes()[:-8])
        config["data"]["sources"] = [str(tokens)]
        return config, f"data.sources: safetensors file {tokens} is truncated"
    assert case == "inside-data"  # a data folder given as a source: the run's files would be read as data
    data = tmp_path / "data"
    config = disk_config(tmp_path, parent, run_dir=str(data / "run"))
    config["data"]["sources"] = [str(data)]
    return (
        config,
        f"run_dir: its token cache {data / 'run' / 'tokens'} would be or lie inside {data}, an input",
    )


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        # The `x` left out: at most 0.75 parameters, which no architecture meets; the line says what was meant.
        (
            "active_params<=0.75",
            "infeasible: budget active_params<=0.75 (total <= 0.75) cannot be met on its own: the best this "
            "library reaches is 44268 (active_params<=0.75: best reachable 44268); budget 'active_params<=0.75' "
            "bounds the parameters used per token at 0.75 (the parent's: 48,364); did you mean "
            "active_params<=0.75x?",
        ),
        # Below the space's smallest child (44268 active parameters): no hint, the budget is a factor already.
        (
            "active_params<=0.05x",
            "infeasible: budget active_params<=0.05x (total <= 2418.2) cannot be met on its own: the best this "
            "library reaches is 44268 (active_params<=0.05x: best reachable 44268)",
        ),
    ],
)
def test_config_check_and_run_refuse_an_unmeetable_budget_alike(
    tmp_path, parent_dir, capsys, budget, expected
):
    """`config check` makes the checks `puzzle run` makes before its first stage: a budget that no architecture
    of the space meets is refused by both, with the same line, before anything is written."""
    data = disk_config(tmp_path, parent_dir, search={"budgets": [budget]})
    path = write(tmp_path, yaml.safe_dump(data))
    for command in ("config check", "run"):
        code, out, err = run_cli([*command.split(), str(path)], capsys)
        assert (code, out, err) == (2, "", f"puzzle {command}: {expected}\n")
    assert not Path(data["run_dir"]).exists()


@pytest.mark.parametrize("case", ["truncated", "empty", "unwritable", "inside-data", "truncated-data"])
def test_config_check_and_run_refuse_the_same_bad_inputs(tmp_path, parent_dir, capsys, case):
    """What `puzzle run` would refuse, `puzzle config check` refuses too: exit 2 and one line naming the key
    and the file, from both; the run writes nothing (not even its logs) before refusing."""
    data, expected = _bad_input(tmp_path, parent_dir, case)
    path = write(tmp_path, yaml.safe_dump(data))
    for command in ("config check", "run"):
        code, out, err = run_cli([*command.split(), str(path)], capsys)
        assert code == 2 and out == "", err
        assert err.count("\n") == 1 and err.startswith(f"puzzle {command}: error: {path}"), err
        assert expected in err, err
    run_dir = Path(data["run_dir"])
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_a_run_beside_its_data_file_is_accepted(tmp_path, parent_dir, capsys):
    """`project/data.jsonl` with `run_dir: project/runs/x`: the folder holding a data file is not an input,
    so `config check` and `run` accept it; the run caches its tokens in the run directory, beside nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i + 2 for i in range(62)}  # the parent's 64 ids
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        tokenizer
    )
    project = tmp_path / "project"
    project.mkdir()
    lines = [json.dumps({"text": " ".join(f"w{(7 * d + i) % 62}" for i in range(40))}) for d in range(12)]
    (project / "data.jsonl").write_text("\n".join(lines) + "\n")
    config = disk_config(tmp_path, parent_dir, run_dir=str(project / "runs" / "x"), tokenizer=str(tokenizer))
    config["data"] = {"sources": [str(project / "data.jsonl")], "seq_len": 8}
    config["search"] = {"budgets": ["params<=0.95x"]}
    config["importance"] = {"tokens": 64, "batch_size": 2}  # the first stage, kept small
    path = write(tmp_path, yaml.safe_dump(config))
    code, _, err = run_cli(["config", "check", str(path)], capsys)
    assert code == 0, err
    code, _, err = run_cli(["run", "--quiet", "--until", "importance", str(path)], capsys)
    assert code == 0, err
    assert sorted(p.name for p in project.iterdir()) == ["data.jsonl", "runs"]
    assert any((project / "runs" / "x" / "tokens").iterdir())


def test_a_corrupt_weights_file_is_exit_2_from_convert_too(tmp_path, parent_dir, capsys):
    broken = _broken_parent(tmp_path, parent_dir, "truncated")
    code, out, err = run_cli(["convert", str(broken), str(tmp_path / "out")], capsys)
    data_bytes = (parent_dir / "model.safetensors").stat().st_size - _header_end(parent_dir)
    assert code == 2 and out == ""
    assert err == (
        f"puzzle convert: error: safetensors file {broken / 'model.safetensors'} is truncated: its header "
        f"describes {data_bytes} bytes of tensor data, the file holds {data_bytes - 100}\n"
    )
    assert not (tmp_path / "out").exists()


def _header_end(checkpoint: Path) -> int:
    """Bytes before the tensor data of checkpoint/model.safetensors: 8, then the JSON header."""
    with open(checkpoint / "model.safetensors", "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


# ----------------------------------------------------------------------------------------------------------
# Examples and the reference page.


def test_the_examples_load_and_fit_their_parents():
    nano = load_config(EXAMPLES / "nemotron3_nano.yaml")  # the parent need not exist here
    variants = nano.search_space().all_variants(nemotron3_nano())
    assert len(variants[0]) == 1 and len(variants[1]) > 10  # block 0 frozen; MoE blocks searched
    assert nano.round_budgets() == [
        ["active_params<=0.7x", "throughput[chat]>=1.3x", "concurrent_requests[long]>=8"]
    ]
    assert nano.bld.dtype == "bfloat16" and nano.hardware.profile == "h100-80gb"
    demo = load_config(EXAMPLES / "demo.yaml")
    assert demo.round_budgets() == [["active_params<=0.85x"], ["active_params<=0.7x"]]  # two budgets
    assert demo.search.engines == ("vllm", "llama.cpp")  # children both engines serve
    # Every block of the demo parent has variants.
    demo_variants = demo.search_space().all_variants(demo_parent_spec())
    assert all(len(v) > 1 for v in demo_variants.values())
    for config in (nano, demo):
        assert load_config_data(config.to_dict()) == config


def test_the_reference_page_is_up_to_date():
    committed = (ROOT / "docs" / "CONFIG.md").read_text()
    assert committed == reference_markdown(), "run: python -m puzzle config reference > docs/CONFIG.md"


def test_every_field_of_the_run_config_sections_is_documented():
    for _, cls in _sections():
        if cls.__module__ == "puzzle.config.run":
            assert all(item.metadata.get("doc") for item in dataclasses.fields(cls)), cls


def test_data_settings_match_token_data_load():
    config = load_config_data(BASE)
    parameters = set(inspect.signature(TokenData.load).parameters) - {"cls"}
    assert set(config.data.token_data_kwargs(config.tokenizer_dir)) == parameters


def test_validating_a_config_imports_no_torch():
    """`import puzzle.config; load_config(...)` in a fresh interpreter: the stages' settings come from the
    torch-free `puzzle.settings`, so checking a YAML file never imports torch (nor a stage module)."""
    stages = ["torch", "puzzle.bld", "puzzle.score", "puzzle.gkd", "puzzle.model"]
    script = f"""
import json, sys
import puzzle.config
configs = [puzzle.config.load_config(path) for path in {[str(p) for p in EXAMPLE_CONFIGS]!r}]
puzzle.config.reference_markdown()
print(json.dumps({{"configs": len(configs), "loaded": [name for name in {stages!r} if name in sys.modules]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"configs": 4, "loaded": []}
