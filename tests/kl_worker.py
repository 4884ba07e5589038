"""One rank of the 2-gloo-rank measured-KL test (tests/test_assemble.py); imports only torch and puzzle, so
that spawning it is cheap."""

from __future__ import annotations

import json
from pathlib import Path

from gloo_helpers import gloo_rank
from safetensors.torch import load_file

import puzzle
from puzzle.compare import compare_models


def worker(rank: int, world: int, port: int, parent_dir: str, child_dir: str, batches_file: str) -> None:
    with gloo_rank(rank, world, port):
        stored = load_file(batches_file)
        batches = [stored[str(index)] for index in range(len(stored))]
        result = compare_models(puzzle.load(parent_dir), puzzle.load(child_dir), batches, vocab_chunk=16)
        Path(child_dir).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(result.to_dict()))
