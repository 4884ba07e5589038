"""Quickstart: load a NemotronH checkpoint with puzzle, check it against transformers, cost it, generate.

A tiny random parent stands in for a real one (nothing is downloaded); the same calls load
NVIDIA-Nemotron-3-Nano-30B-A3B from its directory. Runs in seconds on a CPU:

    python examples/quickstart.py [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.utils import logging as hf_logging

import puzzle
from puzzle.cost.analytic import (
    model_active_params,
    model_params,
    model_weight_bytes,
    state_bytes_per_request,
)
from puzzle.model import parameter_counts

hf_logging.set_verbosity_error()  # silence "falling back to the PyTorch implementation" on CPU
hf_logging.disable_progress_bar()


def tiny_parent() -> NemotronHForCausalLM:
    """A 6-block Nemotron-3-style parent: Mamba, latent MoE, attention, dense MLP."""
    config = NemotronHConfig(
        vocab_size=256,
        hidden_size=64,
        layers_block_type=["linear_attention", "moe", "linear_attention", "full_attention", "moe", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64,
        moe_latent_size=32,
        routed_scaling_factor=2.5,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return NemotronHForCausalLM(config).eval()


@contextmanager
def run_directory(out_dir: str | Path | None):
    """(directory, how to name a path in it): `out_dir`, kept; else a temporary directory, deleted on exit."""
    if out_dir is not None:
        yield Path(out_dir), str
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp), lambda path: f"{path} (temporary: deleted at exit; --out DIR keeps it)"


def main(out_dir: str | Path | None = None) -> None:
    parent = tiny_parent()
    with run_directory(out_dir) as (run, where):
        path = run / "parent"
        parent.save_pretrained(path)
        model = puzzle.load(path)  # reads config.json + safetensors lazily, one tensor at a time

        ids = torch.randint(0, model.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            diff = (model(ids).logits - parent(ids).logits).abs().max().item()
        print(f"max |logits - transformers logits| = {diff:.2e}")

        print(f"pattern: {model.spec.pattern}   (M mamba, E MoE, * attention, - MLP)")
        for kind, count in parameter_counts(model).items():
            print(f"  {kind:<10} {count:>10,} parameters")
        print(f"  {'total':<10} {sum(p.numel() for p in model.parameters()):>10,}")

        # The analytic cost model works from the spec alone (no weights), the same numbers for a 120B parent.
        spec = model.spec
        print("costs from the spec alone:")
        print(
            f"  parameters        {model_params(spec):>12,}  (active per token {model_active_params(spec):,})"
        )
        print(f"  weights bf16      {model_weight_bytes(spec, 'bf16'):>12,.0f} bytes")
        print(f"  weights nvfp4     {model_weight_bytes(spec, 'nvfp4'):>12,.0f} bytes")
        print(
            f"  state / request   {state_bytes_per_request(spec, context_len=4096):>12,} bytes at 4096 tokens"
        )

        prompt = ids[:1, :8]
        generated = model.generate(prompt, max_new_tokens=12)
        print(f"prompt    {prompt[0].tolist()}")
        print(f"generated {generated[0, 8:].tolist()}")

        out = model.save_pretrained(run / "copy")  # the hub layout transformers reads back
        print(f"saved to {where(out)}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="keep the checkpoints (parent, copy) in this directory")
    main(parser.parse_args().out)
