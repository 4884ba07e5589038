"""A tiny pipeline run: a trained 4-block NemotronH parent saved as a checkpoint, tokenised safetensors data
and a run config over a small space; shared by tests/test_run.py and run as a script by its kill tests.

As a script (`python run_helpers.py CONFIG STAGE CALL`): `puzzle run CONFIG`, announcing (file `stalled`
beside CONFIG) and then sleeping at the CALL-th training step of BLD (STAGE `library`) or the CALL-th
scored batch (STAGE `scores`), to be SIGKILLed there; STAGE `none` runs through. Either way the number of
BLD steps and scored batches this process computed is written to `counts-{pid}.json` beside CONFIG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from puzzle.model import HybridLM
from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec

SPEC = ModelSpec(
    vocab_size=40,
    hidden_size=16,
    blocks=(
        MambaSpec(num_heads=4, head_dim=4, state_size=8, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4),
        MLPSpec(width=16),
        MoESpec(num_experts=4, top_k=2, expert_width=8, shared_width=8),
    ),
)
SEQ = 16


def token_stream(count: int, seed: int) -> torch.Tensor:
    """Tokens with structure to learn: each a fixed function of the previous two, 10% noise."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [int(t) for t in torch.randint(0, SPEC.vocab_size, (2,), generator=generator)]
    for _ in range(count - 2):
        nxt = (3 * tokens[-1] + tokens[-2] + 1) % SPEC.vocab_size
        if torch.rand(1, generator=generator).item() < 0.1:
            nxt = int(torch.randint(0, SPEC.vocab_size, (1,), generator=generator))
        tokens.append(nxt)
    return torch.tensor(tokens)


def make_inputs(root: Path) -> dict:
    """Write root/parent (a trained checkpoint) and root/data/tokens.safetensors; returns a config dict."""
    tokens = token_stream(SEQ * 400, seed=1)
    torch.manual_seed(0)
    model = HybridLM(SPEC)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = tokens.view(-1, SEQ)
    for step in range(30):
        batch = rows[(step * 8) % 320 :][:8]
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, SPEC.vocab_size), batch[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(root / "parent")
    (root / "data").mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": tokens}, str(root / "data" / "tokens.safetensors"))
    return config_dict(root)


def config_dict(root: Path, run_dir: str = "run") -> dict:
    return {
        "run_dir": str(root / run_dir),
        "seed": 0,
        "parent": {"path": str(root / "parent"), "dtype": "float32"},
        "data": {
            "sources": [str(root / "data")],
            "seq_len": SEQ,
            "held_out_fraction": 0.2,
            "batch_size": 4,
            "eval_batch_size": 4,
            "held_out_tokens": 256,
        },
        "space": {
            "kinds": {
                "attention": {"noop": True},
                "mlp": {"width_fraction": [0.5], "noop": True},
                "moe": {"top_k": [1]},
            }
        },
        "importance": {"tokens": 512, "batch_size": 4},
        # Two variants per wave at most: two waves, so a kill can fall after a finished one.
        "bld": {
            "lr": 3e-3,
            "token_budget": 640,
            "checkpoint_every": 3,
            "dtype": "float32",
            "shard": "none",
            "memory_limit_bytes": 70_000,
        },
        "scoring": {"vocab_chunk": 16, "variants_per_wave": 1},
        "search": {"budgets": ["active_params<=0.8x"]},
        "gkd": {
            "lr": 1e-3,
            "token_budget": 640,
            "batch_size": 4,
            "eval_every": 5,
            "checkpoint_every": 5,
            "shard": "none",
            "vocab_chunk": 16,
        },
        "hardware": {
            "profile": "h100",
            "scenarios": {"chat": {"batch_size": 1, "prompt_tokens": 16, "generated_tokens": 16}},
        },
    }


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def torchrun_puzzle(ranks: int, *args: str, timeout: float = 300) -> None:
    """`torchrun --standalone --nproc-per-node RANKS -m puzzle ARGS...` on gloo, quiet and single-threaded
    per rank (two ranks on two cores), failing the calling test on a non-zero exit."""
    env = {
        **os.environ,
        "PUZZLE_PROGRESS": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    subprocess.run([*launcher, "-m", "puzzle", *args], env=env, check=True, timeout=timeout)


def main(config: Path, stage: str, call: int) -> int:
    import puzzle.bld
    import puzzle.score
    from puzzle.cli import main as puzzle_main

    counts = {"library": 0, "scores": 0}

    def counting(module, name: str, what: str):
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            counts[what] += 1
            (config.parent / f"counts-{os.getpid()}.json").write_text(json.dumps(counts))
            if what == stage and counts[what] == call:
                (config.parent / "stalled").write_text("1")
                time.sleep(600)
            return original(*args, **kwargs)

        setattr(module, name, wrapped)

    counting(puzzle.bld, "_train_step", "library")
    counting(puzzle.score, "_score_batch", "scores")
    code = puzzle_main(["run", str(config), "--quiet"])
    (config.parent / f"counts-{os.getpid()}.json").write_text(json.dumps(counts))
    return code


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
