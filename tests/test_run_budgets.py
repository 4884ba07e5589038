"""`puzzle.run.Run` from Python refuses an unmeetable budget before any stage runs, as `puzzle run` does: the
training stages check the budgets first, so nothing is tokenised, trained or written (the search's message)."""

from __future__ import annotations

import pytest
from run_helpers import config_dict, make_inputs

from puzzle.config import load_config_data
from puzzle.run import Run
from puzzle.search.types import InfeasibleError


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_budgets")
    make_inputs(root)
    return root


@pytest.mark.parametrize("stage", ["importance", "library", "scores", "all"])
def test_an_unmeetable_budget_is_refused_before_any_stage_output(root, tmp_path, stage):
    data = config_dict(root, run_dir=str(tmp_path / "run"))
    data["search"]["budgets"] = ["params<=100"]
    run = Run(tmp_path / "run", load_config_data(data))
    with pytest.raises(InfeasibleError, match="params"):
        getattr(run, stage)()
    assert not (tmp_path / "run").exists()  # no config, manifest, tokens or stage output


def test_a_meetable_budget_is_checked_once(root, tmp_path):
    data = config_dict(root, run_dir=str(tmp_path / "run"))
    run = Run(tmp_path / "run", load_config_data(data))
    run.check_budgets(run.config.validate_paths())
    assert run._budgets_checked  # the stages below do not search the whole space again
    run.importance()
    assert (tmp_path / "run" / "importance" / "importance.manifest.json").is_file()
