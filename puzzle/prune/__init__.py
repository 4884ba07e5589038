"""Child initialisation: activation importance of every prunable axis (importance.py) and weight surgery (init.py)."""

from puzzle.prune.importance import (
    BlockImportance,
    ModelImportance,
    collect_block_importance,
    collect_importance,
    importance_for,
    load_importance,
    parent_fingerprint,
    save_importance,
)
from puzzle.prune.init import expert_widths_by_importance, init_child, linear_fit, top_indices

__all__ = [
    "BlockImportance",
    "ModelImportance",
    "collect_block_importance",
    "collect_importance",
    "expert_widths_by_importance",
    "importance_for",
    "init_child",
    "linear_fit",
    "load_importance",
    "parent_fingerprint",
    "save_importance",
    "top_indices",
]
