"""The parent's fingerprint: from its files (`fingerprint_checkpoint`, first call and cached call) against the
old `fingerprint_model` of the loaded parent (which a Run needed a load for).

    python benchmarks/bench_fingerprint.py [--mb 100] [--dir /tmp/bench_fp]

Prints one JSON object of seconds. The first call's figure depends on the page cache: the checkpoint was
just written, so its pages are likely cached (a cold 241 GB read is disk-bound: about 241 GB / disk rate
divided over the ranks).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

import puzzle
from puzzle.artifacts import fingerprint_checkpoint, fingerprint_model
from puzzle.cost import model_params
from puzzle.model import HybridLM
from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec


def _parent(megabytes: float) -> HybridLM:
    """A fp32 parent of about `megabytes` MB: Mamba / MLP / attention blocks of hidden size 512."""
    hidden, blocks = 512, []
    while True:
        blocks += [
            MambaSpec(num_heads=16, head_dim=64, state_size=16, n_groups=2, chunk_size=64),
            MLPSpec(width=2048),
            AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64),
        ]
        spec = ModelSpec(vocab_size=8000, hidden_size=hidden, blocks=tuple(blocks))
        if 4 * model_params(spec) >= megabytes * 1e6:
            torch.manual_seed(0)
            return HybridLM(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_fingerprint"))
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    folder = args.dir / "parent"
    _parent(args.mb).save_pretrained(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    cache = args.dir / "parent_hash.json"
    timings = {"checkpoint_mb": round(size / 1e6, 1)}
    for label in ("files_first_s", "files_cached_s"):
        started = time.perf_counter()
        fingerprint_checkpoint(folder, cache)
        timings[label] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    parent = puzzle.load(folder)
    timings["load_s"] = round(time.perf_counter() - started, 4)
    started = time.perf_counter()
    fingerprint_model(parent)
    timings["fingerprint_model_s"] = round(time.perf_counter() - started, 4)
    timings["old_total_s"] = round(timings["load_s"] + timings["fingerprint_model_s"], 4)
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
