"""Export of assembled children: puzzle.load and transformers read them back with the same logits, puzzle.json
says what the child is, the config follows what vLLM and llama.cpp read (every MoE entry states width and
top-k, one global Mamba shape, MTP blocks in mtp_block_configs), engine exports refuse what an engine cannot
load, the parent's directory is never written, and a Super-shaped child on the meta device round-trips."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from assemble_helpers import AUX_FILES, build_small_library, held_out, save_parent
from bld_helpers import trained_parent, variants
from nemotron_helpers import random_hf_model, save_hf, tiny_config, token_batch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import NemotronHForCausalLM

import puzzle
from puzzle.assemble import assemble, measured_kl
from puzzle.export import ExportError, export, export_config
from puzzle.model import HybridLM
from puzzle.nemotron_h import CheckpointError, config_from_spec, spec_from_config
from puzzle.nemotron_h.engines import engine_problems
from puzzle.presets import nemotron3_super, puzzle_75b_a9b_like
from puzzle.search.types import Solution
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, Variant


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _logits(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory):
    """The trained every-kind parent (linear and no-op blocks, per-expert widths) and its library."""
    root = tmp_path_factory.mktemp("export_every_kind")
    parent_dir = save_parent(trained_parent(), root / "parent")
    library = build_small_library(puzzle.load(parent_dir), root / "library")
    return parent_dir, library


@pytest.fixture(scope="module")
def homogeneous(tmp_path_factory):
    """A transformers NemotronH parent (latent MoE) with an MTP module, and a library whose variants shrink
    every MoE block alike and every Mamba block alike (so the child stays one shape per kind)."""
    root = tmp_path_factory.mktemp("export_homogeneous")
    # Mamba inner width 4 x 16 = 64: llama.cpp's converter asserts a multiple of 64.
    hf = random_hf_model(tiny_config("latent_moe", mamba_head_dim=16), seed=4)
    plain = save_hf(hf, root / "hf")
    parent_dir = root / "parent"
    parent_dir.mkdir()
    config = json.loads((plain / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    (parent_dir / "config.json").write_text(json.dumps(config))
    mtp = {
        "mtp.layers.0.eh_proj.weight": torch.randn(32, 64),
        "mtp.layers.1.mixer.gate.weight": torch.randn(8, 32),
    }
    save_file({**load_file(plain / "model.safetensors"), **mtp}, parent_dir / "model.safetensors")
    for name, text in AUX_FILES.items():
        (parent_dir / name).write_text(text)
    parent = puzzle.load(parent_dir)
    moe = MoESpec(8, 3, 8, 24, 12, 2.5, True, 2, 1)
    mamba = MambaSpec(num_heads=4, head_dim=16, state_size=4, n_groups=2, chunk_size=8, dt_clamp_min=0.001)
    table = {
        index: [Variant(index, mamba if block.kind == "mamba" else moe)]
        for index, block in enumerate(parent.spec.blocks)
        if block.kind in ("mamba", "moe")
    }
    library = build_small_library(parent, root / "library", table)
    return parent_dir, library, hf, mtp, table


def test_puzzle_child_exports_with_its_record_and_reloads_with_identical_logits(every_kind, tmp_path):
    parent_dir, library = every_kind
    before = _snapshot(parent_dir)
    parent = puzzle.load(parent_dir)
    table = variants()
    child = assemble({0: table[0][1], 2: table[2][0], 3: table[3][0]}, library, parent)
    measured = measured_kl(child, parent, held_out())
    out = export(child, tmp_path / "child", parent_dir=parent_dir)
    files = {path.name for path in out.iterdir()}
    assert {"config.json", "model.safetensors", "puzzle.json", *AUX_FILES} <= files
    for name, text in AUX_FILES.items():
        assert (out / name).read_text() == text
    reloaded = puzzle.load(out)
    assert reloaded.spec == child.spec
    for ids in held_out():
        assert torch.equal(_logits(reloaded, ids), _logits(child, ids))
    record = json.loads((out / "puzzle.json").read_text())
    assert record["model_type"] == "nemotron_h_puzzle"
    assert record["parent"] == {"path": str(parent_dir.resolve()), "fingerprint": library.parent}
    assert [entry["variant"] for entry in record["solution"]] == [b.short_name() for b in child.spec.blocks]
    assert [entry["source"] for entry in record["solution"]] == ["library"] + ["parent"] + ["library"] * 2 + [
        "parent"
    ] * 2
    assert record["changed_blocks"] == [0, 2, 3]
    assert record["predicted"]["params"] == sum(p.numel() for p in child.parameters())
    assert record["measured"]["kl"] == measured["kl"] > 0
    assert record["mtp"]["handling"].startswith("none") and record["mtp"]["tensors"] == 0
    assert record["engines"]["vllm"] and record["engines"]["llama.cpp"]  # linear / no-op blocks
    assert ModelSpec.from_dict(record["spec"]) == child.spec
    assert _snapshot(parent_dir) == before


def test_a_saved_solution_is_recorded_as_it_is(every_kind, tmp_path):
    """`export(solution=...)` takes a Solution or its saved JSON (solutions/{name}.json): puzzle.json holds the
    same search record either way, without a search table rebuilt to read the JSON."""
    parent_dir, library = every_kind
    parent = puzzle.load(parent_dir)
    table = variants()
    child = assemble({0: table[0][1], 2: table[2][0]}, library, parent)
    solution = Solution(
        choices=(1, 0, 0, 0, 0, 0),
        names={f"block_{i}": "v" for i in range(6)},
        objective=0.25,
        totals={"params": 123.0},
        status="optimal",
        gap=0.0,
        solver="highs",
        seconds=0.5,
    )
    saved = json.loads(json.dumps(solution.to_json()))
    records = []
    for given, folder in ((solution, "typed"), (saved, "saved")):
        out = export(child, tmp_path / folder, parent_dir=parent_dir, solution=given)
        records.append(json.loads((out / "puzzle.json").read_text())["search"])
    assert records[0] == records[1] == saved


def test_the_card_of_an_assembled_child_shows_its_blocks_and_measured_kl(every_kind, tmp_path):
    parent_dir, library = every_kind
    parent = puzzle.load(parent_dir)
    table = variants()
    child = assemble({0: table[0][1], 2: table[2][0]}, library, parent)
    measured = measured_kl(child, parent, held_out())
    text = (export(child, tmp_path / "child", parent_dir=parent_dir) / "README.md").read_text()
    assert f"base_model: {parent_dir.name}\n" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows[:3] == [
        f"| 0 | `{parent.spec.blocks[0].short_name()}` | `{child.spec.blocks[0].short_name()}` | library |",
        f"| 1 | `{parent.spec.blocks[1].short_name()}` | `{child.spec.blocks[1].short_name()}` | parent |",
        f"| 2 | `{parent.spec.blocks[2].short_name()}` | `{child.spec.blocks[2].short_name()}` | library |",
    ]
    assert child.spec.blocks[0] != parent.spec.blocks[0]
    assert measured["predicted_kl"] is None  # assembled from variants, not from a search's solution
    assert f"| held-out KL of the assembled child | - | {measured['kl']:.6g} |" in text
    assert f"before GKD: {measured['kl']:.6g} nats/token; not distilled" in text
    assert "the budgets are not known" in text  # no run: the search's budgets are not in the child


def test_never_writes_into_the_parent_directory(every_kind):
    parent_dir, library = every_kind
    before = _snapshot(parent_dir)
    child = assemble({}, library, puzzle.load(parent_dir))
    for target in (parent_dir, parent_dir / "child", parent_dir.parent):
        with pytest.raises(CheckpointError, match="must stay untouched"):
            export(child, target, parent_dir=parent_dir)
    assert _snapshot(parent_dir) == before


def test_engine_export_refuses_what_an_engine_cannot_load(every_kind, tmp_path):
    parent_dir, library = every_kind
    child = assemble({}, library, puzzle.load(parent_dir))
    with pytest.raises(ExportError) as error:
        export(child, tmp_path / "child", format="engine")
    message = str(error.value)
    for expected in (
        "vllm: block 2 (moe): moe_intermediate_size [8, 6, 8, 8, 4] is a list: vLLM's FusedMoE takes one",
        "vllm: block 4 (linear): vLLM raises on layer type 'L'",
        "vllm: block 5 (noop): vLLM raises on layer type 'N'",
        "llama.cpp: block 3 (mlp): a dense MLP block in a model with MoE blocks (llama.cpp's converter marks "
        "only MoE blocks as feed-forward layers, and its loader takes this block for a Mamba layer)",
        "llama.cpp: block 4 (linear)",
    ):
        assert expected in message
    assert not (tmp_path / "child").exists()
    with pytest.raises(CheckpointError, match="cannot be written as a plain nemotron_h config"):
        export(child, tmp_path / "child", format="nemotron_h")


def test_engine_rules_block_by_block():
    mamba = MambaSpec(num_heads=4, head_dim=16, state_size=8, n_groups=2)
    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4)
    moe = MoESpec(num_experts=8, top_k=2, expert_width=16, shared_width=8, latent_size=12)

    def problems(*blocks, engines=("vllm", "llama.cpp")):
        spec = ModelSpec(vocab_size=40, hidden_size=16, blocks=blocks)
        return sorted({(p.engine, p.block) for p in engine_problems(spec, engines)})

    # Per-block width and top-k: both engines (the Puzzle-75B shape); one state size for all Mamba blocks.
    assert problems(mamba, moe, attention, MoESpec(8, 5, 4, 8, 12), mamba.__class__(4, 16, 8, 2)) == []
    assert problems(mamba, moe, MambaSpec(num_heads=4, head_dim=16, state_size=4, n_groups=2)) in (
        [("llama.cpp", 0), ("vllm", 0)],
        [("llama.cpp", 2), ("vllm", 2)],
    )
    # vLLM takes per-block expert counts and no shared expert; llama.cpp does not. Neither: several
    # attention shapes (llama.cpp reads the globals; vLLM's KV cache, conservatively).
    assert problems(moe, MoESpec(4, 2, 16, 8, 12), moe) == [("llama.cpp", 1)]
    # llama.cpp's converter asserts a Mamba inner width (heads x head dim) that is a multiple of 64.
    assert problems(MambaSpec(num_heads=4, head_dim=4, state_size=8, n_groups=2)) == [("llama.cpp", 0)]
    assert problems(attention, attention, AttentionSpec(2, 1, 4)) == [("llama.cpp", 2), ("vllm", 2)]
    assert problems(moe, MoESpec(8, 2, 16, 0, 12)) == [("llama.cpp", 1)]
    assert problems(MLPSpec(width=8, activation="silu")) == [("llama.cpp", 0), ("vllm", 0)]
    assert problems(MLPSpec(width=8), MLPSpec(width=4)) == []
    assert problems(LinearSpec(), engines=("transformers",)) == [("transformers", None)]


def test_homogeneous_child_is_plain_nemotron_h_with_transformers_logits(homogeneous, tmp_path):
    parent_dir, library, _, _, table = homogeneous
    parent = puzzle.load(parent_dir)
    mamba_only = {index: listed[0] for index, listed in table.items() if listed[0].spec.kind == "mamba"}
    child = assemble(mamba_only, library, parent)
    child.extra_tensors = {}  # without the MTP module the uniform child is plain nemotron_h
    child.source_config = {k: v for k, v in child.source_config.items() if k != "num_nextn_predict_layers"}
    out = export(child, tmp_path / "child", format="engine")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron_h" and config["ssm_state_size"] == 4
    assert config["layers_block_type"] == ["mamba", "moe", "attention", "moe", "mamba"]
    reloaded = NemotronHForCausalLM.from_pretrained(out).eval()
    ids = token_batch(seed=9)
    with torch.no_grad():
        assert_close(reloaded(ids).logits, _logits(child, ids), atol=1e-5, rtol=1e-5)
    assert not torch.equal(_logits(child, ids), _logits(parent, ids))


def test_mtp_is_carried_and_described_when_the_child_changes_the_moe_blocks(homogeneous, tmp_path):
    parent_dir, library, _, mtp, table = homogeneous
    parent = puzzle.load(parent_dir)
    child = assemble({index: listed[0] for index, listed in table.items()}, library, parent)
    out = export(child, tmp_path / "child", format="engine")
    config = json.loads((out / "config.json").read_text())
    # Uniform, but the MTP module keeps the parent's MoE (width 16, top-3): nemotron_h would give it the
    # child's globals, so the child is written as nemotron_h_puzzle with the MTP blocks described.
    assert config["model_type"] == "nemotron_h_puzzle" and config["num_nextn_predict_layers"] == 1
    assert "moe_intermediate_size" not in config and config["ssm_state_size"] == 4
    assert config["mtp_layers_block_type"] == ["attention", "moe"]
    mtp_moe = config["mtp_block_configs"][1]
    assert (
        mtp_moe["moe_intermediate_size"],
        mtp_moe["num_experts_per_tok"],
        mtp_moe["n_routed_experts"],
    ) == (16, 3, 8)
    for entry in config["block_configs"]:
        if entry["block_type"] == "moe":  # llama.cpp reads these from every entry, with no fallback
            assert isinstance(entry["moe_intermediate_size"], int) and isinstance(
                entry["num_experts_per_tok"], int
            )
        if entry["block_type"] == "mamba":
            assert entry == {"block_type": "mamba"}  # one global Mamba shape
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved[name], tensor) for name, tensor in mtp.items())
    record = json.loads((out / "puzzle.json").read_text())
    assert record["mtp"]["tensors"] == 2 and record["mtp"]["config"] == "mtp_block_configs"
    assert record["mtp"]["handling"].startswith("carried unchanged")
    reloaded = puzzle.load(out)
    assert set(reloaded.extra_tensors) == set(mtp)
    ids = token_batch(seed=2)
    assert torch.equal(_logits(reloaded, ids), _logits(child, ids))


def test_super_shaped_child_on_meta_round_trips_its_block_configs(tmp_path):
    parent_config = config_from_spec(nemotron3_super())
    parent_config.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    spec = puzzle_75b_a9b_like()
    with torch.device("meta"):
        child = HybridLM(spec)
    child.source_config = parent_config
    config = json.loads(json.dumps(export_config(child, format="engine")))
    assert spec_from_config(config) == spec
    assert config["model_type"] == "nemotron_h_puzzle" and config["num_hidden_layers"] == 88
    assert len(config["block_configs"]) == len(config["layers_block_type"]) == 88
    assert config["ssm_state_size"] == 96
    moe_entries = [entry for entry in config["block_configs"] if entry["block_type"] == "moe"]
    assert len(moe_entries) == 40
    assert all({"moe_intermediate_size", "num_experts_per_tok"} <= set(entry) for entry in moe_entries)
    widths = [(b.expert_width, b.top_k) for b in spec.blocks if isinstance(b, MoESpec)]
    assert [(e["moe_intermediate_size"], e["num_experts_per_tok"]) for e in moe_entries] == widths
    assert {json.dumps(e) for e in config["block_configs"] if e["block_type"] != "moe"} == {
        '{"block_type": "mamba"}',
        '{"block_type": "attention"}',
    }
    mtp_moe = config["mtp_block_configs"][1]
    assert (mtp_moe["moe_intermediate_size"], mtp_moe["num_experts_per_tok"]) == (2688, 22)
    with pytest.raises(CheckpointError, match="meta device"):
        export(child, tmp_path / "child")


def test_the_tokenizer_of_a_puzzle_export_loads_quietly_without_remote_code(tmp_path):
    """`AutoTokenizer.from_pretrained(export, trust_remote_code=False)`, as the README recommends, reads
    config.json too and cannot build a nemotron_h_puzzle config without its code: it reads the entry the export
    writes for it instead of warning that the model type is not its own. The model itself still loads (puzzle,
    transformers with remote code) and the entry is not carried twice through a reload and re-export."""
    import logging

    from transformers import AutoConfig, AutoTokenizer

    from puzzle.demo.corpus import write_tokenizer

    parent_dir = save_parent(
        HybridLM(ModelSpec(vocab_size=258, hidden_size=16, blocks=(MLPSpec(8),))), tmp_path / "p"
    )
    write_tokenizer(parent_dir)
    child = HybridLM(ModelSpec(vocab_size=258, hidden_size=16, blocks=(MLPSpec(width=8), MLPSpec(width=12))))
    out = export(child, tmp_path / "child", parent_dir=parent_dir, format="nemotron_h_puzzle")
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron_h_puzzle"

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    library_logger = logging.getLogger("transformers")  # every transformers module logs below it
    level = library_logger.level
    library_logger.addHandler(handler)
    library_logger.setLevel(logging.WARNING)  # whatever an earlier test set: the warning would be emitted
    try:
        tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=False)
    finally:
        library_logger.removeHandler(handler)
        library_logger.setLevel(level)
    assert [record.getMessage() for record in records] == []
    assert tokenizer("ab")["input_ids"] == AutoTokenizer.from_pretrained(parent_dir)("ab")["input_ids"]

    assert type(AutoConfig.from_pretrained(out, trust_remote_code=True)).__name__ == "NemotronHPuzzleConfig"
    reloaded = puzzle.load(out)
    assert reloaded.spec == child.spec
    config = json.loads((out / "config.json").read_text())
    again = json.loads((export(reloaded, tmp_path / "again") / "config.json").read_text())
    assert again == config
