"""demo.md's text: which held-out data each of the parent's losses is on, and a note for a child that keeps
no token mixer (no Mamba, no attention block), rendered by the real `render_table` from table rows."""

from __future__ import annotations

from puzzle.demo.parent import QUICK_SETTINGS
from puzzle.demo.pipeline import QUICK, ModelRow, render_table

# The record's fields render_table reads, as puzzle.demo.parent writes them for the quick parent.
RECORD = {
    "train_tokens": 40_960,
    "held_out_loss": 2.567,
    "unigram_held_out_loss": 3.304,
    "held_out_tokens": 8_192,
    "data": {"seq_len": QUICK_SETTINGS.seq_len},
}


def _row(name: str, blocks: list[str], mixes_tokens: bool, lm_loss: float) -> ModelRow:
    return ModelRow(
        name=name,
        budget="-" if name == "parent" else f"{name}<=0.5x",
        params=1000,
        active_params=800,
        weight_bytes=4000.0,
        kl=0.0 if name == "parent" else 0.2,
        kl_predicted=None if name == "parent" else 0.3,
        kl_before_gkd=None if name == "parent" else 0.25,
        lm_loss=lm_loss,
        top1=1.0,
        predicted_tokens_per_s=100.0,
        measured_tokens_per_s=100.0,
        blocks=blocks,
        mixes_tokens=mixes_tokens,
    )


PARENT = _row("parent", ["mamba:h4", "moe:e8:k2", "attn:q4:kv2:d32"], True, 2.390)
KEPT = _row("kept", ["mamba:h4", "moe:e8:k1", "noop"], True, 2.5)
BIGRAM = _row("bigram", ["noop", "moe:e8:k1", "noop"], False, 2.7)


def test_each_held_out_loss_says_which_data_it_is_on():
    text = render_table([PARENT, KEPT], RECORD, QUICK, 30.0, quick=True)
    header = text.split("\n| model |")[0]
    # The trainer's loss: its own held-out tokens and sequence length; the table's: the run's.
    assert f"its loss on 8,192 held-out tokens in sequences of {QUICK_SETTINGS.seq_len} was 2.567" in header
    assert f"on the run's {QUICK.held_out_tokens:,} held-out tokens in sequences of {QUICK.seq_len}" in header
    assert "| LM loss (run's held-out) |" in text and "| 2.390 |" in text


def test_a_child_without_a_token_mixer_is_noted_and_one_with_is_not():
    text = render_table([PARENT, KEPT, BIGRAM], RECORD, QUICK, 30.0, quick=True)
    notes = [line for line in text.splitlines() if line.startswith("Note: ")]
    assert len(notes) == 1
    assert notes[0].startswith("Note: bigram: it keeps no Mamba or attention block, so nothing in it mixes")
    assert "Note: " not in render_table([PARENT, KEPT], RECORD, QUICK, 30.0, quick=True)


def test_numbers_are_readable_and_the_decode_figure_is_explained():
    """Thousands separators, a budget's bound without scientific notation, and the predicted decode speed
    tied to the report's row of the same figure (its throughput row also counts the prefill)."""
    import dataclasses

    fast = dataclasses.replace(
        KEPT,
        budget="weight_bytes[bf16]<=1.02936e+06",
        measured_tokens_per_s=1821.97,
        predicted_tokens_per_s=1200.7,
    )
    text = render_table([PARENT, fast], RECORD, QUICK, 30.0, quick=True)
    row = next(line for line in text.splitlines() if line.startswith("| kept |"))
    assert "weight_bytes[bf16]<=1,029,360" in row and "| 1,822 | 1,201 |" in row
    assert "e+06" not in text
    assert '"decode speed" row' in text and "prefill" in text
