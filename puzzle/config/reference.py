"""The run config's reference page (docs/CONFIG.md), written from the dataclasses themselves.

Each section's summary is its class docstring; each field's meaning is its `doc` metadata, else its entry
in the class docstring (`` `name`: text ``), so the page cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from collections.abc import Mapping

from puzzle.config.loader import is_union, join_key, to_dict, type_hints, type_name
from puzzle.config.run import RunConfig
from puzzle.cost.roofline import Scenario
from puzzle.search.budget import BUDGET_KEYS
from puzzle.settings import BLDSettings, GKDSettings

# What a reused class's field means in the config, where that differs from its own documentation.
_NOTES: dict[tuple[type, str], str] = {
    (Scenario, "name"): "Set from its key under hardware.scenarios (give it only to repeat the key).",
    (Scenario, "batch_size"): "Concurrent requests.",
    (Scenario, "prompt_tokens"): "Tokens in, per request.",
    (Scenario, "generated_tokens"): "Tokens out, per request.",
    (Scenario, "user_speed"): "Decode tokens/s each user must get (null: none), for `throughput_at_speed[S]` "
    "budgets, which choose the batch themselves (batch_size is not used there).",
    (BLDSettings, "token_budget"): "Tokens each variant trains on (fewer if the data ends first); the "
    "cosine decay of the learning rate ends there.",
    (BLDSettings, "min_lr_ratio"): "The learning rate at the end of the decay, as a fraction of lr.",
    (BLDSettings, "weight_decay"): "AdamW weight decay.",
    (BLDSettings, "betas"): "AdamW betas.",
}
# GKDSettings' docstring documents its fields in running prose; the config page has one line each.
_NOTES.update(
    {
        (GKDSettings, name): text
        for name, text in {
            "lr": "AdamW peak learning rate.",
            "min_lr_ratio": "The learning rate at the end of the cosine decay, as a fraction of lr.",
            "warmup_tokens": "Linear warm-up from 0 over this many tokens.",
            "weight_decay": "AdamW weight decay.",
            "betas": "AdamW betas.",
            "token_budget": "Tokens to train on (null: no token limit; the run also ends after `steps`).",
            "steps": "Optimiser steps (null: no step limit); at least one limit is needed.",
            "batch_size": "Sequences per optimiser step (all ranks together, at least one per rank; need not "
            "divide by the ranks: the shares then differ by one).",
            "micro_batch_size": "At most this many sequences per forward/backward on one rank (null: the rank's "
            "whole share); gradients accumulate over the share, the same micro-batch count on every rank "
            "(`puzzle plan` prints the choice).",
            "clip": "Max global gradient norm (0: none).",
            "kl_weight": "Weight of the logit KL to the parent.",
            "cosine_weight": "Weight of the per-block (1 - cosine) of hidden states.",
            "lm_weight": "Weight of the LM loss (off by default: the Puzzle ablation found it hurts).",
            "vocab_chunk": "lm_head rows per KL chunk (peak memory).",
            "eval_every": "Steps between held-out evaluations (0: only before and after).",
            "checkpoint_every": "Steps between checkpoints (0: never).",
            "seed": "Seeds torch and the order of the batches.",
            "dtype": "The student's training dtype: float32 or bfloat16.",
            "autocast": "bf16 autocast on CUDA.",
            "shard": "fsdp: shard student and teacher over the ranks with FSDP2; hsdp: shard inside a node, replicate across nodes; none: replicate them.",
            "keep_best": "Output the evaluated weights with the lowest held-out KL (the child before any step "
            "included), not the last: GKD never returns a worse child; costs a host copy of the student shard.",
            "early_stop_patience": "Stop after this many evaluations without a lower held-out KL (0: never).",
            "activation_checkpointing": "Keep only each student block's input for the backward and recompute "
            "the block there: the same result, one more student forward per step, far less memory.",
            "select_by": "What keep_best and early_stop_patience call best: kl (the lowest held-out KL) or "
            "TASK/METRIC, an lm-eval task metric of the student at each evaluation (e.g. "
            "puzzle_next_line/acc_norm; TASK must be in eval.tasks, scored with eval's limit and batch size).",
        }.items()
    }
)


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation: its metadata, else its entry in the class docstring (`name`: text)."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    docs = {f.name: f.metadata["doc"] for f in fields if "doc" in f.metadata}
    text = " ".join((cls.__doc__ or "").split())
    names = "|".join(re.escape(f.name) for f in fields)
    markers = list(re.finditer(rf"(?:^|(?<=[\s;.(]))`?({names})`?:\s", text))
    for marker, following in zip(markers, [*markers[1:], None]):
        name = marker.group(1)
        if name not in docs:
            end = following.start() if following is not None else len(text)
            entry = text[marker.end() : end].strip().rstrip(";,").strip()
            docs[name] = re.sub(r"\bNone\b", "null", entry)  # what YAML calls it
    return docs


def _summary(cls: type) -> str:
    """The class docstring up to the first per-field entry."""
    text = " ".join((cls.__doc__ or "").split())
    names = "|".join(re.escape(f.name) for f in dataclasses.fields(cls))
    first = re.search(rf"(?:^|(?<=[\s;.(]))`?({names})`?:\s", text)
    return text[: first.start()].strip() if first else text


def _default_text(item: dataclasses.Field) -> str:
    if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
        return "**required**"
    value = item.default if item.default is not dataclasses.MISSING else item.default_factory()
    if dataclasses.is_dataclass(value):
        return "(section)"
    return f"`{json.dumps(to_dict(value))}`".replace("|", "\\|")


def _sections(cls: type, key: str, out: list[tuple[str, type]]) -> None:
    out.append((key, cls))
    hints = type_hints(cls)
    for item in dataclasses.fields(cls):
        tp = hints[item.name]
        if typing.get_origin(tp) in (dict, Mapping):
            tp, child = typing.get_args(tp)[1], join_key(key, item.name) + ".NAME"
        else:
            child = join_key(key, item.name)
        arms = typing.get_args(tp) if is_union(tp) else ()
        if arms and all(dataclasses.is_dataclass(arm) or arm in (int, float) for arm in arms):
            # A number or a mapping (`rerank: int | RerankConfig`): the mapping's keys get a section.
            tp = next((arm for arm in arms if dataclasses.is_dataclass(arm)), tp)
        if dataclasses.is_dataclass(tp):
            _sections(tp, child, out)


def reference_markdown() -> str:
    """docs/CONFIG.md: every section and field of the run config, with type, default and meaning."""
    import puzzle.space

    lines = [
        "# The run config",
        "",
        "<!-- Generated by puzzle.config.reference_markdown(): `python -m puzzle config reference > "
        "docs/CONFIG.md`. Do not edit by hand. -->",
        "",
        "One YAML file describes a whole run (`puzzle config check CONFIG` validates it and prints it "
        "resolved). Every key below is optional unless marked required; an unknown key is an error that "
        "lists the valid keys at its level; wrong types and impossible values are errors naming the key's "
        "path (exit code 2, before anything is written). Relative paths are relative to the config file's "
        "folder; `~` is expanded. Numbers are YAML numbers (`1e-4`, `1_000_000`); strings are never read as "
        "numbers. Complete examples: `examples/configs/nemotron3_nano.yaml` (Nemotron-3-Nano-30B-A3B on a "
        "GPU node) and `examples/configs/demo.yaml` (the built-in demo).",
        "",
    ]
    sections: list[tuple[str, type]] = []
    _sections(RunConfig, "", sections)
    for key, cls in sections:
        title = f"`{key}`" if key else "Top level"
        origin = f"{cls.__module__}.{cls.__qualname__}"
        summary = _summary(cls)
        lines += [f"## {title}", "", f"{summary} (`{origin}`)" if summary else f"`{origin}`.", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        docs = _field_docs(cls)
        hints = type_hints(cls)
        for item in dataclasses.fields(cls):
            if not item.init:
                continue
            doc = _NOTES.get((cls, item.name)) or docs.get(item.name, "see above")
            doc = doc.replace("|", "\\|")
            lines.append(f"| `{item.name}` | {type_name(hints[item.name])} | {_default_text(item)} | {doc} |")
        lines.append("")
    lines += [
        "## Budgets",
        "",
        "`search.budgets`, `search.sweep` and `rounds.budgets` use the syntax of `puzzle search` "
        "(`KEY<=VALUE`, `KEY>=VALUE`; VALUE absolute such as `3e9`, `70G`, `2.5B`, or a factor of the "
        "round's parent such as `0.6x`; for `throughput`, `1.5x` is 1.5 times the parent's tokens/s) over "
        "these keys. `KEY[S]` names one or more scenarios under `hardware.scenarios` "
        "(`throughput[chat,long]>=1.5x`: the bound holds in each). `throughput_at_speed[S]>=1.6x` compares "
        "the server's tokens/s at the largest batch keeping the scenario's `user_speed` per user; it is not "
        "a sum over blocks, so the search holds the child to the parent's batch at that speed times the "
        "factor (rounded up): that many requests must fit, decode at the speed and give the throughput "
        "(sufficient, not necessary).",
        "",
        "| key | bound | what it bounds |",
        "|---|---|---|",
    ]
    for name, (side, named, meaning) in BUDGET_KEYS.items():
        lines.append(f"| `{name}{'[S]' if named else ''}` | `{side}` | {meaning} |")
    space_doc = (puzzle.space.__doc__ or "").strip()
    lines += ["", "## `space` (inline or in a file)", "", space_doc, ""]
    return "\n".join(lines)
