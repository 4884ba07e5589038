"""Where per-kind behaviour lives: every table keyed by block spec type, one per stage.

A new block kind is a spec class in `puzzle.spec` (added to `BLOCK_SPEC_TYPES`) plus one entry in each
table named here; `tests/test_kinds.py` runs every table against every spec type and names the table
that lacks one. Tables are named by import path, so this module imports no stage.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

# "module:TABLE" -> what the entry of a kind says.
PER_KIND_TABLES: dict[str, str] = {
    "puzzle.blocks.registry:BLOCK_TYPES": "build: the mixer module",
    "puzzle.cost.kinds:BLOCK_COSTS": "cost: params, FLOPs, bytes, KV cache and state",
    "puzzle.prune.importance:IMPORTANCE_COLLECTORS": "importance: the activation statistics collected",
    "puzzle.axes:PRUNING_AXES": "the fields a child may shrink, and which the search space offers",
    "puzzle.prune.init:CHILD_INITS": "child init: the surgery that derives a child from a parent",
    "puzzle.space:SPACE_RULES": "search space: rules across axes (MoE top-k <= experts, width profiles)",
    "puzzle.nemotron_h.config:KIND_TABLES": "checkpoint: config.json fields, names, globals, entry keys",
    "puzzle.nemotron_h.config:TRANSFORMERS_PROBLEMS": "why transformers' NemotronH cannot load a block",
    "puzzle.nemotron_h.engines:VLLM_RULES": "why vLLM cannot load a block",
    "puzzle.nemotron_h.engines:LLAMA_CPP_RULES": "why llama.cpp cannot load a block",
    "puzzle.nemotron_h.engines:SGLANG_RULES": "why SGLang cannot load a block (beyond its replay)",
    "puzzle.nemotron_h.engines:TRTLLM_RULES": "why TensorRT-LLM cannot load a block (beyond its replay)",
    "puzzle.search.kinds:SEARCH_ATTRIBUTES": "search: the attributes a budget's global rules read",
    "puzzle.report:KIND_STYLES": "report: the kind's colour, and whether it mixes tokens",
}


def load_table(name: str) -> Mapping[type, Any]:
    """The table named `module:TABLE` (imports its module)."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)
