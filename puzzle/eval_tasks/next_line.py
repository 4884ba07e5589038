"""The loader of the `puzzle_next_line` task: its JSONL beside this file, as the `test` split (no hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("next_line.jsonl")


def load(**_: Any) -> dict[str, Any]:
    """{"test": a datasets.Dataset of the items}; lm-eval's `custom_dataset` hook passes metadata, unused here."""
    import json

    import datasets

    # from_list, not from_json: nothing written to the datasets cache for 300 small rows
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
