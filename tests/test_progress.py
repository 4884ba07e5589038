"""Progress bars: shown when forced, silent when switched off, and the items pass through unchanged."""

from __future__ import annotations

import pytest

from puzzle.progress import progress


@pytest.mark.parametrize(("setting", "shown"), [("1", True), ("0", False)])
def test_progress_setting(monkeypatch, capsys, setting: str, shown: bool) -> None:
    monkeypatch.setenv("PUZZLE_PROGRESS", setting)
    assert list(progress(iter(range(5)), "counting", total=5, unit="item")) == [0, 1, 2, 3, 4]
    err = capsys.readouterr().err
    assert ("counting" in err) is shown
    if shown:
        assert "0/5 [" in err  # the bar, with its total, was drawn
