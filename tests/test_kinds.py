"""Every per-kind table covers every block spec type: a new kind that misses one fails here, by table name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import puzzle
from puzzle.kinds import PER_KIND_TABLES, load_table
from puzzle.spec import (
    BLOCK_SPEC_TYPES,
    AttentionSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
)

SPEC_TYPES = list(BLOCK_SPEC_TYPES.values())
SAMPLES = (
    MambaSpec(num_heads=4, head_dim=8, state_size=16, n_groups=2),
    AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
    MoESpec(num_experts=4, top_k=2, expert_width=16, shared_width=8),
    MLPSpec(width=32),
    LinearSpec(),
    NoOpSpec(),
)


def check_entry(table_name: str, spec_type: type) -> None:
    """Fails naming the table when it has no entry for `spec_type`."""
    table = load_table(table_name)
    assert spec_type in table, (
        f"{table_name} ({PER_KIND_TABLES[table_name]}) has no entry for {spec_type.__name__}; "
        "a block kind needs one entry in every table of puzzle.kinds.PER_KIND_TABLES"
    )


@pytest.mark.parametrize("spec_type", SPEC_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("table_name", list(PER_KIND_TABLES), ids=lambda name: name.split(":")[1])
def test_every_table_has_an_entry_for_every_spec_type(table_name, spec_type):
    check_entry(table_name, spec_type)


@pytest.mark.parametrize("table_name", list(PER_KIND_TABLES), ids=lambda name: name.split(":")[1])
def test_tables_hold_spec_types_only(table_name):
    extra = [key for key in load_table(table_name) if key not in SPEC_TYPES]
    assert not extra, f"{table_name} has keys that are no block spec type: {extra}"


def test_a_missing_entry_names_its_table(monkeypatch):
    """The check above can fail, and says which table a new kind missed."""
    table = load_table("puzzle.space:SPACE_RULES")
    monkeypatch.delitem(table, MLPSpec)
    with pytest.raises(AssertionError, match=r"puzzle.space:SPACE_RULES .* no entry for MLPSpec"):
        check_entry("puzzle.space:SPACE_RULES", MLPSpec)


def _spec_keyed_tables(path: Path) -> list[str]:
    """Module-level dicts of `path` keyed by spec types: annotated `dict[type, ...]`, or spelt with spec keys."""
    names = {cls.__name__ for cls in SPEC_TYPES}
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
            if ast.unparse(node.annotation).startswith("dict[type"):
                found.append(target)
                continue
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            target, value = node.targets[0].id, node.value
        else:
            continue
        if isinstance(value, ast.Dict) and any(isinstance(k, ast.Name) and k.id in names for k in value.keys):
            found.append(target)
    return found


def test_every_table_keyed_by_spec_type_is_registered():
    """A new per-kind table must join PER_KIND_TABLES, or a new kind could miss it unnoticed."""
    root = Path(puzzle.__file__).parent
    found = {
        f"{'.'.join(path.relative_to(root.parent).with_suffix('').parts)}:{name}"
        for path in root.rglob("*.py")
        for name in _spec_keyed_tables(path)
    }
    assert found - set(PER_KIND_TABLES) == set()
    assert set(PER_KIND_TABLES) <= found  # and every registered one is such a table


def test_search_attributes_match_what_the_budget_writes():
    """The attributes `deployment_problem` gives each choice are `puzzle.search.kinds`' (its one source)."""
    from puzzle.search.budget import Budget, deployment_problem
    from puzzle.search.kinds import search_attributes

    parent = ModelSpec(vocab_size=64, hidden_size=32, blocks=SAMPLES[:4])
    variants = [
        [block, *(s for s in SAMPLES if s is not block and type(s) in (LinearSpec, NoOpSpec))]
        for block in parent.blocks
    ]
    scores = [[0.0] * len(options) for options in variants]
    problem = deployment_problem(parent, variants, scores, Budget.of(params=0.9 * 10**9))
    specs = [spec for options in variants for spec in options]
    assert problem.table.attrs.keys() >= {"kind", "state_size", "top_k"}
    for row, spec in enumerate(specs):
        written = {key: values[row] for key, values in problem.table.attrs.items() if values[row] is not None}
        assert written == search_attributes(spec), spec


# ---------------------------------------------------------------------------------------------------
# Tables keyed by kind NAME (strings), where the spec types cannot be imported: the remote code (torch and
# transformers only), the vLLM replay (vLLM's characters) and the config defaults (keyed by config key).
# Each kind is either in the table or exempt for a stated reason; a new kind must be one or the other.

# "module:TABLE" -> {kind: why it has no entry}
STRING_KEYED_TABLES: dict[str, dict[str, str]] = {
    "puzzle.nemotron_h.remote.configuration_nemotron_h_puzzle:_PATTERN_CHARS": {},
    "puzzle.nemotron_h.remote.modeling_nemotron_h_puzzle:MIXERS": {"noop": "a removed block has no mixer"},
    "puzzle.nemotron_h.remote.modeling_nemotron_h_puzzle:CACHE_LAYERS": {
        "moe": "stateless between tokens (DummyLayer)",
        "mlp": "stateless between tokens (DummyLayer)",
        "linear": "stateless between tokens (DummyLayer)",
        "noop": "stateless between tokens (DummyLayer)",
    },
    "puzzle.nemotron_h.vllm_replay:_CHARS": {
        "linear": "vLLM has no such layer type (the replay reports it unsupported)",
        "noop": "vLLM has no such layer type (the replay reports it unsupported)",
    },
}


def check_string_table(table_name: str, table, kind: str) -> None:
    """Fails naming the table when `kind` has neither an entry nor a stated exemption."""
    exempt = STRING_KEYED_TABLES[table_name]
    assert kind in table or kind in exempt, (
        f"{table_name} has no entry for kind {kind!r} and no reason it needs none "
        "(tests/test_kinds.py STRING_KEYED_TABLES)"
    )
    assert not (kind in table and kind in exempt), f"{table_name}: {kind!r} is both present and exempt"


@pytest.mark.parametrize("kind", [cls.kind for cls in SPEC_TYPES])
@pytest.mark.parametrize("table_name", list(STRING_KEYED_TABLES), ids=lambda name: name.split(":")[1])
def test_every_string_keyed_table_covers_every_kind(table_name, kind):
    check_string_table(table_name, load_table(table_name), kind)


def test_remote_kind_names_cover_every_name_puzzle_reads():
    from puzzle.nemotron_h.config import _KIND_NAMES
    from puzzle.nemotron_h.remote.configuration_nemotron_h_puzzle import KIND_NAMES

    assert KIND_NAMES == _KIND_NAMES


@pytest.mark.parametrize("spec_type", SPEC_TYPES, ids=lambda t: t.__name__)
def test_config_defaults_cover_every_config_field_of_every_kind(spec_type):
    """Every config.json key a kind writes has a default in ours and in the remote code's (the same one)."""
    from puzzle.nemotron_h.config import DEFAULTS, KIND_TABLES
    from puzzle.nemotron_h.remote.configuration_nemotron_h_puzzle import BLOCK_DEFAULTS

    for field in KIND_TABLES[spec_type].fields:
        assert field.key in DEFAULTS, (
            f"puzzle.nemotron_h.config:DEFAULTS lacks {field.key!r} ({spec_type.__name__})"
        )
        assert field.key in BLOCK_DEFAULTS, (
            f"remote BLOCK_DEFAULTS lacks {field.key!r} ({spec_type.__name__})"
        )
        assert DEFAULTS[field.key] == BLOCK_DEFAULTS[field.key], field.key


def test_a_missing_string_entry_or_default_names_its_table(monkeypatch):
    """The checks above can fail: a kind dropped from a string table, a key dropped from the defaults."""
    name = "puzzle.nemotron_h.remote.modeling_nemotron_h_puzzle:CACHE_LAYERS"
    table = load_table(name)
    monkeypatch.delitem(table, "attention")
    with pytest.raises(AssertionError, match=r"CACHE_LAYERS has no entry for kind 'attention'"):
        check_string_table(name, table, "attention")
    from puzzle.nemotron_h.remote import configuration_nemotron_h_puzzle as remote_config

    monkeypatch.delitem(remote_config.BLOCK_DEFAULTS, "sliding_window")
    with pytest.raises(AssertionError, match="remote BLOCK_DEFAULTS lacks 'sliding_window'"):
        test_config_defaults_cover_every_config_field_of_every_kind(AttentionSpec)
