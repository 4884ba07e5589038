"""The loaders of the local tasks (`puzzle_next_line`, `puzzle_identifiers`): their JSONL beside this file, as the `test` split (no hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("next_line.jsonl")
IDENTIFIERS = Path(__file__).with_name("identifiers.jsonl")


def load(**_: Any) -> dict[str, Any]:
    """{"test": a datasets.Dataset of the items}; lm-eval's `custom_dataset` hook passes metadata, unused here."""
    return _load(DATA)


def load_identifiers(**_: Any) -> dict[str, Any]:
    """puzzle_identifiers' {"test": a datasets.Dataset of its items}."""
    return _load(IDENTIFIERS)


def _load(path: Path) -> dict[str, Any]:
    import json

    import datasets

    # from_list, not from_json: nothing written to the datasets cache for 300 small rows
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
