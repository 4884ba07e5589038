"""The model card (README.md) `puzzle.export` writes into every export, in Hugging Face hub conventions.

YAML front matter (`library_name`, `base_model`, `tags`, `pipeline_tag`, and the parent's `license` when its
config.json or README front matter names one), then: what the child is and its blocks against the parent's;
the budgets it was searched under with predicted and measured costs; held-out KL before and after GKD; which
engines serve it (`puzzle.nemotron_h.engines`) and the command for each; how it was made (puzzle version,
the run config's fingerprint). What is not known (a standalone export has no run) is said, not invented.

A card carries `CARD_MARKER`: a README.md without it is the user's and is never overwritten
(`card_owner`); one with it is puzzle's and counts as a checkpoint file when the export is redone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from puzzle.files import CARD_FILE, CARD_MARKER
from puzzle.spec import ModelSpec

TAGS = ("puzzle", "nemotron_h", "neural-architecture-search", "pruning", "knowledge-distillation")
ENGINE_TITLES = {
    "transformers": "transformers",
    "vllm": "vLLM",
    "llama.cpp": "llama.cpp",
    "sglang": "SGLang",
    "trtllm": "TensorRT-LLM",
}


def _front_matter(text: str) -> dict[str, Any]:
    """The YAML front matter of a README (between the leading `---` lines), {} when none or unreadable."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    for end, line in enumerate(lines[1:], start=1):
        if line.strip() == "---":
            try:
                data = yaml.safe_load("\n".join(lines[1:end]))
            except yaml.YAMLError:
                return {}
            return data if isinstance(data, dict) else {}
    return {}


def parent_license(parent_dir: Path | None) -> str | None:
    """The parent's license: config.json's `license`, else its README.md front matter's; None if neither."""
    if parent_dir is None:
        return None
    for read in (
        lambda: json.loads((parent_dir / "config.json").read_text()).get("license"),
        lambda: _front_matter((parent_dir / CARD_FILE).read_text()).get("license"),
    ):
        try:
            found = read()
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str) and found.strip():
            return found.strip()
    return None


def base_model(parent_dir: Path | None, parent_config: Mapping[str, Any] | None) -> str | None:
    """The parent's hub id when its config names one (`_name_or_path` like `org/name`), else its folder name."""
    name = (parent_config or {}).get("_name_or_path")
    if isinstance(name, str) and name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return name
    return None if parent_dir is None else parent_dir.name


def _parent_spec(parent_config: Mapping[str, Any] | None) -> ModelSpec | None:
    if parent_config is None:
        return None
    from puzzle.nemotron_h.config import spec_from_config

    try:
        return spec_from_config(parent_config)
    except Exception:  # a parent we cannot read block by block: the table shows the child alone
        return None


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def _architecture(spec: ModelSpec, parent: ModelSpec | None, record: Mapping[str, Any]) -> list[str]:
    sources = [entry.get("source") for entry in record.get("solution", [])]
    lines = ["## Architecture", ""]
    changed = record.get("changed_blocks")
    lines.append(
        f"{spec.num_blocks} blocks, hidden size {spec.hidden_size}, vocabulary {spec.vocab_size}"
        + (f"; {len(changed)} block(s) differ from the parent" if changed is not None else "")
        + ". Blocks by their puzzle variant id (kind and shape):"
    )
    lines += ["", "| block | parent | child | from |", "|---:|---|---|---|"]
    for index, block in enumerate(spec.blocks):
        before = parent.blocks[index].short_name() if parent and index < parent.num_blocks else "-"
        source = sources[index] if index < len(sources) and sources[index] else "-"
        lines.append(f"| {index} | `{before}` | `{block.short_name()}` | {source} |")
    predicted = record.get("predicted", {})
    if "params" in predicted:
        lines += ["", f"Parameters: {predicted['params']:,} ({predicted.get('active_params', 0):,} active)."]
    return lines


def _search(record: Mapping[str, Any], run: Mapping[str, Any] | None) -> list[str]:
    lines = ["## Search", ""]
    search, measured = record.get("search"), record.get("measured")
    budgets = (run or {}).get("budgets")
    if run is None and search is None and not measured:
        return [*lines, "Exported standalone (not from a puzzle run): no search budgets or costs are known."]
    if budgets:
        lines += ["Searched under the budgets:", "", *(f"- `{budget}`" for budget in budgets), ""]
    elif run is None:
        lines += ["Exported standalone (not from a puzzle run): the budgets are not known.", ""]
    rows = []
    if search is not None:
        rows.append(("KL (objective, summed replace-one-block scores)", search.get("objective"), None))
        rows += [(name, value, None) for name, value in (search.get("totals") or {}).items()]
    if measured:
        rows.append(("held-out KL of the assembled child", measured.get("predicted_kl"), measured.get("kl")))
    if rows:
        lines += ["| cost | predicted | measured |", "|---|---:|---:|"]
        lines += [f"| {name} | {_figure(pred)} | {_figure(meas)} |" for name, pred, meas in rows]
        if search is not None:
            lines += ["", f"Solver: {search.get('solver', '-')}, status {search.get('status', '-')}."]
    return lines


def _quality(record: Mapping[str, Any], run: Mapping[str, Any] | None) -> list[str]:
    distill = (run or {}).get("distill")
    before = (record.get("measured") or {}).get("kl")
    lines = ["## Quality", ""]
    if distill:
        first = distill.get("first_eval") or {}
        last = distill.get("kept_eval") or distill.get("last_eval") or {}  # the weights kept
        kept = distill.get("kept_step")
        kept_note = (
            ""
            if kept is None or kept == distill.get("steps")
            else f"; step {kept} kept, the best held-out KL"
        )
        before = first.get("kl") if before is None else before  # the assembled child's measured KL first
        lines += [
            "| held-out KL(parent ‖ child), nats/token | value |",
            "|---|---:|",
            f"| before GKD (assembled) | {_figure(before)} |",
            f"| after GKD ({distill.get('steps', '-')} steps, {distill.get('tokens', '-')} tokens{kept_note}) "
            f"| {_figure(last.get('kl'))} |",
        ]
        weights = "distilled (GKD)" if (run or {}).get("source") == "distill" else "assembled, not distilled"
        return [*lines, "", f"The weights exported here are the {weights} ones."]
    if before is not None:
        return [
            *lines,
            f"Held-out KL(parent ‖ child) before GKD: {_figure(before)} nats/token; not distilled.",
        ]
    return [*lines, "No held-out KL known (exported standalone)."]


def engine_commands(model_type: str) -> dict[str, list[str]]:
    """{engine: the commands that serve an export at ./CHILD} (trust_remote_code for nemotron_h_puzzle)."""
    remote = model_type == "nemotron_h_puzzle"
    load = "trust_remote_code=True" if remote else ""
    return {
        "transformers": [
            f'AutoModelForCausalLM.from_pretrained("./CHILD"{", " + load if load else ""})',
        ],
        "vllm": [f"vllm serve ./CHILD{' --trust-remote-code' if remote else ''}"],
        "llama.cpp": [
            "python convert_hf_to_gguf.py ./CHILD --outfile child.gguf --outtype bf16",
            "llama-server -m child.gguf",
        ],
        # SGLang and TensorRT-LLM register nemotron_h_puzzle's config class themselves: no remote code.
        "sglang": ["python -m sglang.launch_server --model-path ./CHILD"],
        "trtllm": ["trtllm-serve ./CHILD"],
    }


def _serving(spec: ModelSpec, model_type: str, record: Mapping[str, Any]) -> list[str]:
    from puzzle.nemotron_h.engines import engine_support

    # the record's verdicts when it has them: they know the stored layout and the KV cache, the spec does not
    support = record.get("engines") or engine_support(spec)
    commands = engine_commands(model_type)
    lines = [
        "## Serving",
        "",
        f"`model_type`: `{model_type}`; `./CHILD` below is this directory (or its hub id). "
        '`puzzle.load("./CHILD")` reads it as well.',
        "",
    ]
    for engine, reasons in support.items():
        title = ENGINE_TITLES.get(engine, engine)
        modelopt = (record.get("quant_layout") or {}).get("layout") == "modelopt"
        if engine == "transformers" and model_type == "nemotron_h_puzzle" and not modelopt:
            reasons = []  # the checkpoint's own modelling code reads every block puzzle writes (not ModelOpt's)
        if reasons:
            lines += [f"- **{title}**: does not serve this child:", *(f"  - {reason}" for reason in reasons)]
            continue
        lines.append(f"- **{title}**: serves it:")
        lines += ["", "  ```", *(f"  {command}" for command in commands.get(engine, [])), "  ```", ""]
    return lines


def _provenance(record: Mapping[str, Any], run: Mapping[str, Any] | None) -> list[str]:
    from puzzle import __version__

    parent = record.get("parent") or {}
    lines = ["## How it was made", "", f"- puzzle {__version__}"]
    if run is not None:
        lines.append(f"- run config fingerprint: `{run.get('config_fingerprint', '-')}`")
        if run.get("solution"):
            lines.append(f"- solution `{run['solution']}` ({run.get('solution_file', '-')})")
    else:
        lines.append("- exported standalone (`puzzle.export`), not from a puzzle run")
    if parent.get("fingerprint"):
        lines.append(f"- parent fingerprint: `{parent['fingerprint']}`")
    lines.append(
        "- `puzzle.json` beside this file holds the full record (solution, predictions, measurements)"
    )
    return lines


def model_card(
    spec: ModelSpec,
    record: Mapping[str, Any],
    *,
    parent_dir: Path | None = None,
    parent_config: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
) -> str:
    """The README.md text of an export: `record` is its puzzle.json (`puzzle.export.export_record`), `run`
    what `run_card_info` says of the run it came from (None: exported standalone)."""
    base = base_model(parent_dir, parent_config)
    front: dict[str, Any] = {"library_name": "transformers"}
    if base is not None:
        front["base_model"] = base
    license_ = parent_license(parent_dir)
    if license_ is not None:
        front["license"] = license_
    front["tags"] = [*TAGS, record["model_type"]] if record["model_type"] != "nemotron_h" else list(TAGS)
    front["pipeline_tag"] = "text-generation"
    title = f"Puzzle child of {base}" if base else "Puzzle child"
    intro = (
        f"A compressed child of {f'`{base}`' if base else 'its parent'}, made by the `puzzle` library "
        "(Puzzle NAS: blockwise local distillation of block variants, a mixed-integer search under deployment "
        "budgets, then global knowledge distillation)."
    )
    sections = [
        _architecture(spec, _parent_spec(parent_config), record),
        _search(record, run),
        _quality(record, run),
        _serving(spec, record["model_type"], record),
        _provenance(record, run),
    ]
    body = [f"# {title}", "", CARD_MARKER, "", intro]
    for section in sections:
        body += ["", *section]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).rstrip()  # sections end in blank lines of their own
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n" + text + "\n"
