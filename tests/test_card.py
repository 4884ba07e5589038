"""The model card (README.md) of every export: hub front matter, the blocks against the parent, what is known
of the search and GKD (and that a standalone export knows neither), the engines that serve it with their
commands, provenance; a README.md the user placed at the export path is never overwritten."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import puzzle
from puzzle.export import export
from puzzle.files import CARD_MARKER, card_owner
from puzzle.model import HybridLM
from puzzle.nemotron_h import CheckpointError
from puzzle.nemotron_h.engines import engine_support
from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec
from tests.nemotron_helpers import EVERY_KIND_SPEC

HOMOGENEOUS = ModelSpec(
    vocab_size=40,
    hidden_size=16,
    blocks=(
        MambaSpec(num_heads=4, head_dim=4, state_size=8, n_groups=2, chunk_size=8),
        MoESpec(num_experts=4, top_k=2, expert_width=8, shared_width=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4),
        MoESpec(num_experts=4, top_k=2, expert_width=8, shared_width=8),
    ),
)


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def section(text: str, title: str) -> str:
    """The text of `## title` up to the next section."""
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def child_of(spec: ModelSpec) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(spec).eval()


@pytest.mark.parametrize("spec", [EVERY_KIND_SPEC, HOMOGENEOUS], ids=["every_kind", "homogeneous"])
def test_a_standalone_export_has_a_card_that_says_what_is_not_known(spec, tmp_path):
    out = export(child_of(spec), tmp_path / "child")
    text = (out / "README.md").read_text()
    front = front_matter(text)
    model_type = json.loads((out / "config.json").read_text())["model_type"]
    assert front["library_name"] == "transformers" and "puzzle" in front["tags"]
    assert "base_model" not in front and "license" not in front  # no parent known
    assert CARD_MARKER in text and card_owner(out) == "puzzle"
    assert "Exported standalone" in section(text, "Search") and "exported standalone" in section(
        text, "Quality"
    )
    table = section(text, "Architecture")
    for index, block in enumerate(spec.blocks):
        assert f"| {index} | `-` | `{block.short_name()}` |" in table
    # Engines: served exactly when puzzle.nemotron_h.engines finds no problem, with the command for each.
    serving = section(text, "Serving")
    for engine, reasons in engine_support(spec).items():
        title = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}.get(engine, engine)
        served = not reasons or (engine == "transformers" and model_type == "nemotron_h_puzzle")
        assert (f"**{title}**: serves it" in serving) == served, engine
        assert all(reason in serving for reason in reasons) or served
    remote = model_type == "nemotron_h_puzzle"
    assert ("trust_remote_code=True" in serving) == remote
    if not engine_support(spec)["vllm"]:
        assert f"vllm serve ./CHILD{' --trust-remote-code' if remote else ''}\n" in serving
    assert f"puzzle {puzzle.__version__}" in section(text, "How it was made")


def test_the_card_reads_the_parents_license_and_name_and_compares_blocks(tmp_path):
    parent = child_of(EVERY_KIND_SPEC).save_pretrained(tmp_path / "Parent-7B")
    (parent / "README.md").write_text(
        "---\nlicense: other\nlicense_name: nvidia-open-model-license\n---\n# P\n"
    )
    child_spec = ModelSpec(
        vocab_size=40, hidden_size=16, blocks=(MLPSpec(width=4), *EVERY_KIND_SPEC.blocks[1:])
    )
    out = export(child_of(child_spec), tmp_path / "child", parent_dir=parent)
    text = (out / "README.md").read_text()
    assert front_matter(text) | {"tags": None} == {
        "library_name": "transformers",
        "base_model": "Parent-7B",
        "license": "other",
        "tags": None,
        "pipeline_tag": "text-generation",
    }
    table = section(text, "Architecture")
    assert f"| 0 | `{EVERY_KIND_SPEC.blocks[0].short_name()}` | `mlp:w4` |" in table
    assert (
        f"| 1 | `{EVERY_KIND_SPEC.blocks[1].short_name()}` | `{child_spec.blocks[1].short_name()}` |" in table
    )
    # config.json's license wins over the README's; a hub id in _name_or_path is the base model.
    config = json.loads((parent / "config.json").read_text())
    (parent / "config.json").write_text(
        json.dumps({**config, "license": "apache-2.0", "_name_or_path": "org/P"})
    )
    front = front_matter(
        (export(child_of(child_spec), tmp_path / "again", parent_dir=parent) / "README.md").read_text()
    )
    assert (front["license"], front["base_model"]) == ("apache-2.0", "org/P")


def test_a_readme_the_user_placed_is_never_overwritten(tmp_path):
    target = tmp_path / "child"
    target.mkdir()
    (target / "README.md").write_text("# my notes\n")
    with pytest.raises(CheckpointError, match=r"README\.md"):
        export(child_of(EVERY_KIND_SPEC), target)  # foreign file: refused without overwrite
    export(child_of(EVERY_KIND_SPEC), target, overwrite=True)
    assert (target / "README.md").read_text() == "# my notes\n" and card_owner(target) == "user"
    assert "the user's" in json.loads((target / "puzzle.json").read_text())["model_card"]


def test_our_own_card_is_a_checkpoint_file_when_exporting_again(tmp_path):
    out = export(child_of(EVERY_KIND_SPEC), tmp_path / "child")
    (out / "README.md").write_text((out / "README.md").read_text().replace("# Puzzle child", "# stale"))
    export(child_of(HOMOGENEOUS), out)  # an earlier export, our card included: no overwrite=True needed
    text = (out / "README.md").read_text()
    assert "# stale" not in text and f"`{HOMOGENEOUS.blocks[0].short_name()}`" in text
