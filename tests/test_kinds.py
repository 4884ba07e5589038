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
