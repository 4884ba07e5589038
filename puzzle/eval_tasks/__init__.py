"""Local lm-eval tasks, offline: task YAMLs, their JSONL data and the loader they name (`puzzle.eval` registers them)."""
