"""The search attributes of each block kind: what a budget's global rules group a block's choices by.

`search_attributes(spec)` is a `Choice.attrs` dict: the kind, plus the kind's own entries (Mamba state
size, for "one ssm state size for all Mamba blocks"; MoE top-k). Torch-free, like the rest of the search.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    MoESpec,
    NoOpSpec,
    kind_entry,
)


def _none(spec: Any) -> dict[str, Hashable]:
    return {}


SEARCH_ATTRIBUTES: dict[type, Callable[[Any], dict[str, Hashable]]] = {
    MambaSpec: lambda spec: {"state_size": spec.state_size},
    AttentionSpec: _none,
    MoESpec: lambda spec: {"top_k": spec.top_k},
    MLPSpec: _none,
    LinearSpec: _none,
    NoOpSpec: _none,
}


def search_attributes(spec: BlockSpec) -> dict[str, Hashable]:
    """{"kind": spec.kind, ...the kind's attributes} for a `puzzle.search.Choice`."""
    own = kind_entry(SEARCH_ATTRIBUTES, spec, "no search attributes for block spec type")(spec)
    return {"kind": spec.kind, **own}
