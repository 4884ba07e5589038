"""On a CUDA machine: the GPU path (mamba_ssm kernels when installed, else torch on CUDA) against the CPU reference.

Builds a small hybrid model with every block kind, including a Mamba block whose head count is not a
multiple of 8 (what pruned children have), copies the same weights to the GPU, and compares in fp32:
a full forward, prefill + step-by-step decode, and greedy generation. Then times prefill and decode
on both devices (ratio GPU / CPU). Writes benchmarks/results/gpu_check.json and exits non-zero when
an output differs beyond the tolerance. Also checks the MoE expert bank in bf16: its grouped path (one
grouped_mm per projection) against its loop, with no host synchronisation, and times the two.
On a machine without CUDA it says so and exits 0.

    python benchmarks/gpu_check.py                 # ~1 minute on one GPU
    pip install -e '.[cuda]'                       # first, to exercise the mamba_ssm kernels
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from puzzle.blocks import mamba as mamba_module
from puzzle.blocks.moe import ExpertBank
from puzzle.cost.timing import median_seconds
from puzzle.model import HybridLM
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec

RESULTS = Path(__file__).parent / "results" / "gpu_check.json"


def check_spec(hidden: int) -> ModelSpec:
    """Every block kind; the second Mamba block has 12 heads of 24 channels and state 40 (no multiple of 8)."""
    return ModelSpec(
        vocab_size=512,
        hidden_size=hidden,
        blocks=(
            MambaSpec(num_heads=16, head_dim=32, state_size=64, n_groups=4, chunk_size=64),
            MoESpec(num_experts=16, top_k=4, expert_width=128, shared_width=256, latent_size=128),
            AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64),
            MambaSpec(num_heads=12, head_dim=24, state_size=40, n_groups=2, chunk_size=64),
            MLPSpec(width=4 * hidden),
            LinearSpec(),
            NoOpSpec(),
        ),
    )


def compare(cpu_model: HybridLM, gpu_model: HybridLM, ids: torch.Tensor, atol: float) -> dict[str, float]:
    """Largest absolute logit difference GPU vs CPU for a full forward and for prefill + decode."""
    device = next(gpu_model.parameters()).device
    with torch.no_grad():
        full = (gpu_model(ids.to(device)).logits.cpu() - cpu_model(ids).logits).abs().max().item()
        split = ids.shape[1] // 2
        cache = gpu_model.init_cache(ids.shape[0])
        steps = [gpu_model(ids[:, :split].to(device), cache=cache).logits.cpu()]
        for position in range(split, ids.shape[1]):
            steps.append(gpu_model(ids[:, position : position + 1].to(device), cache=cache).logits.cpu())
        decoded = (torch.cat(steps, dim=1) - cpu_model(ids).logits).abs().max().item()
        prompt = ids[:1, :16]
        same_tokens = torch.equal(
            gpu_model.generate(prompt.to(device), max_new_tokens=32).cpu(),
            cpu_model.generate(prompt, max_new_tokens=32),
        )
    return {
        "forward_max_abs": full,
        "prefill_decode_max_abs": decoded,
        "generate_equal": same_tokens,
        "atol": atol,
    }


def check_expert_bank(experts: int = 128, top_k: int = 8, width: int = 256, size: int = 256) -> dict:
    """bf16 ExpertBank on the GPU: grouped path vs the loop (max abs diff), no host sync, times of both."""
    torch.manual_seed(2)
    bank = ExpertBank(size, (width,) * experts).to("cuda", torch.bfloat16)
    tokens = 512
    h = torch.randn(tokens, size, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(tokens, top_k, device="cuda")
    indices = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    out: dict[str, object] = {"grouped_used": bank.uses_grouped(h)}
    with torch.no_grad():
        bank.path = "loop"
        loop = bank(h, weights, indices).float()
        bank.path = "grouped"
        bank(h, weights, indices)  # warm-up outside the sync check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            grouped = bank(h, weights, indices).float()
            out["grouped_syncs_host"] = False
        except RuntimeError as error:  # the sync debug mode raises on a host synchronisation
            out["grouped_syncs_host"] = str(error)[:200]
            grouped = None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if grouped is None:
            grouped = bank(h, weights, indices).float()
        out["grouped_vs_loop_max_abs"] = (grouped - loop).abs().max().item()
        out["loop_max_abs"] = loop.abs().max().item()
        cuda = torch.device("cuda")
        for path in ("loop", "grouped"):
            bank.path = path
            out[f"{path}_ms"] = 1e3 * median_seconds(
                lambda: bank(h, weights, indices), repeats=20, warmup=3, device=cuda
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--tokens", type=int, default=300, help="sequence length (not a multiple of the chunk)"
    )
    parser.add_argument(
        "--atol", type=float, default=2e-3, help="fp32 kernels use TF32-free but reordered sums"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU path is what the test suite covers)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cpu_model = HybridLM(check_spec(args.hidden)).eval()
    gpu_model = HybridLM(check_spec(args.hidden)).eval()
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.to("cuda")
    ids = torch.randint(0, 512, (2, args.tokens), generator=torch.Generator().manual_seed(1))
    kernels = mamba_module._kernels_for(torch.empty(0, device="cuda")) is not None
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "mamba_kernels": kernels,
        "torch": torch.__version__,
        **compare(cpu_model, gpu_model, ids, args.atol),
        "expert_bank_bf16": check_expert_bank(),
    }
    with torch.no_grad():
        cpu_s = median_seconds(lambda: cpu_model(ids), repeats=3, warmup=1)
        gpu_ids = ids.cuda()
        gpu_s = median_seconds(lambda: gpu_model(gpu_ids), repeats=10, warmup=3, device=torch.device("cuda"))
    result["prefill_gpu_over_cpu"] = gpu_s / cpu_s
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    bank = result["expert_bank_bf16"]
    ok = (
        result["forward_max_abs"] <= args.atol
        and result["prefill_decode_max_abs"] <= args.atol
        and result["generate_equal"]
        and bank["grouped_used"]
        and bank["grouped_syncs_host"] is False
        # bf16 outputs: the grouped kernel and the loop's matmuls round differently (a few bf16 ulps).
        and bank["grouped_vs_loop_max_abs"] <= 0.02 * bank["loop_max_abs"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
