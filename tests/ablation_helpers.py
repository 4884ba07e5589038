"""The benchmarks' ablation modules and a tiny trained demo parent for their tests (test_ablations,
test_precision_bench)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from puzzle.demo.corpus import stdlib_root
from puzzle.demo.parent import TrainSettings, demo_parent
from puzzle.presets.demo import demo_spec

ROOT = Path(__file__).resolve().parents[1]
TINY_PARENT = TrainSettings(seq_len=32, batch_size=4, steps=25, lr=1e-2, warmup_steps=3, held_out_sequences=4)


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module NAME, loaded once per process (its siblings import it by that name,
    and dataclasses look their module up in sys.modules)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_parent(root: Path) -> Any:
    """A 4-block demo parent (Mamba, MoE, attention, MoE; hidden 32) trained briefly, cached under `root`."""
    return demo_parent(
        root / "cache",
        progress=False,
        spec=demo_spec("ME*E", 32, num_experts=4, top_k=2, num_heads=4),
        settings=TINY_PARENT,
        corpus_root=stdlib_root() / "email",
    )


def tiny_size(ablations: ModuleType, **changes: Any) -> Any:
    """The ablations' smoke sizes cut to the tiny parent, with `changes` (e.g. the space)."""
    size = dataclasses.replace(
        ablations.SMOKE,
        seq_len=32,
        held_out_tokens=512,
        importance_tokens=256,
        bld_tokens=512,
        gkd_tokens=256,
    )
    return dataclasses.replace(size, **changes)
