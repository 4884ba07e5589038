"""One rank of the 2-gloo-rank measured-KL test (tests/test_assemble.py); imports only torch and puzzle, so
that spawning it is cheap."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

import puzzle
from puzzle import dist
from puzzle.score import compare_models


def worker(rank: int, world: int, port: int, parent_dir: str, child_dir: str, batches_file: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    assert dist.init_from_env() is True
    try:
        stored = load_file(batches_file)
        batches = [stored[str(index)] for index in range(len(stored))]
        result = compare_models(puzzle.load(parent_dir), puzzle.load(child_dir), batches, vocab_chunk=16)
        Path(child_dir).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(result.to_dict()))
    finally:
        torch.distributed.destroy_process_group()
