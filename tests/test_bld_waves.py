"""BLD's waves sized from the plan (`bld.variants_per_wave: auto`, the default): `puzzle run` trains the waves
`puzzle plan` shows, the three ways of sizing them say why, and the Super example on the seed's space fits
64 H100s and 2 nodes of 8 B200s and is refused on one H100 naming the stage and the part."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from run_helpers import SPEC as RUN_SPEC
from run_helpers import make_inputs, write_config

from puzzle.cli import main
from puzzle.config import load_config
from puzzle.plan import bld_wave_limit, bld_waves, plan_config, run_memory
from puzzle.run import Run
from puzzle.settings import BLDSettings

ROOT = Path(__file__).resolve().parent.parent
SUPER_H100 = ROOT / "examples" / "nemotron3_super" / "config.yaml"
OTHERS = {"parent shard": 3 * 2**30, "gathered unit": 2**30, "block input/target": 0}


def test_a_runs_auto_waves_are_the_waves_puzzle_plan_shows(tmp_path, caplog):
    """On the CPU a run sizes auto's waves against this machine's memory per rank x hardware.memory_fraction;
    `puzzle plan` for a GPU of that memory groups the same variants into the same waves."""
    data = make_inputs(tmp_path)
    del data["bld"]["memory_limit_bytes"]  # the default: variants_per_wave auto
    data["space"]["kinds"]["mamba"] = {"state_size": [4]}
    data["space"]["kinds"]["mlp"]["width_fraction"] = [0.75, 0.5, 0.25]
    config = load_config(write_config(tmp_path / "run.yaml", data))
    host, _ = run_memory(config)
    count = sum(len(w) for w in bld_waves(config, RUN_SPEC, 1, host)[0])
    # The largest memory_fraction (of halvings) that splits the library into several waves.
    fraction = 1.0
    while len(bld_waves(load_with(tmp_path, data, fraction), RUN_SPEC, 1, host)[0]) < 2:
        fraction /= 2
    config = load_with(tmp_path, data, fraction)
    planned, limit = bld_waves(config, RUN_SPEC, 1, host)
    assert count >= 5 and 2 <= len(planned) < count and "auto" in limit.reason and limit.oversized == "alone"

    with caplog.at_level(logging.INFO, logger="puzzle.bld"):
        library = Run.from_config(tmp_path / "run.yaml").library()
    assert library.plan == planned
    assert f"in {len(planned)} wave(s); {limit.reason}" in caplog.text


def load_with(tmp_path: Path, data: dict, fraction: float):
    data["hardware"]["memory_fraction"] = fraction
    return load_config(write_config(tmp_path / "run.yaml", data))


def test_the_wave_limit_says_which_setting_sized_the_waves():
    gib = 2**30
    auto = bld_wave_limit(BLDSettings(), OTHERS, 10 * gib)
    assert auto.bytes == 6 * gib and auto.max_variants is None and auto.oversized == "alone"
    assert auto.reason == (
        "bld.variants_per_wave auto: 6.0 GiB per rank for a wave's variants = usable 10.0 GiB - parent shard "
        "3.0 GiB - gathered unit 1.0 GiB"
    )
    counted = bld_wave_limit(BLDSettings(variants_per_wave=3), OTHERS, 10 * gib)
    assert (counted.bytes, counted.max_variants, counted.oversized) == (None, 3, "raise")
    assert "at most 3 variants a wave" in counted.reason
    assert "all variants in one wave" in bld_wave_limit(BLDSettings(variants_per_wave=None), OTHERS, 1).reason
    given = bld_wave_limit(BLDSettings(memory_limit_bytes=gib), OTHERS, 10 * gib)
    assert (given.bytes, given.oversized) == (
        gib,
        "raise",
    ) and "bld.memory_limit_bytes 1.0 GiB" in given.reason
    starved = bld_wave_limit(BLDSettings(), OTHERS, 2 * gib)
    assert starved.bytes == 0 and "nothing is left per rank" in starved.reason
    assert "usable 2.0 GiB < parent shard 3.0 GiB + gathered unit 1.0 GiB" in starved.reason
    with pytest.raises(
        ValueError, match=r"variants_per_wave must be 'auto', an integer >= 1 or None, found 0"
    ):
        BLDSettings(variants_per_wave=0)


@pytest.mark.parametrize(
    ("gpus", "hardware"), [(64, "h100-80gb"), (16, "b200")], ids=["64 H100", "2 nodes of 8 B200"]
)
def test_the_super_example_fits_with_default_waves(gpus, hardware):
    config = load_config(SUPER_H100)
    assert config.bld.variants_per_wave == "auto" and config.bld.memory_limit_bytes is None
    plan = plan_config(config, gpus, hardware)
    assert plan.misfits() == []
    library = {s.name: s for s in plan.stages}["library"]
    assert "variants to train" in library.units and "bld.variants_per_wave auto" in library.units
    waves = int(library.units.split(" in ")[1].split(" waves")[0])
    assert 1 < waves < 1131, library.units  # neither one wave of everything nor one variant per wave


def test_the_super_example_is_refused_on_one_h100_naming_the_stage_and_part(capsys):
    assert main(["plan", str(SUPER_H100), "--gpus", "1", "--hardware", "h100-80gb"]) == 2
    err = capsys.readouterr().err
    assert "does not fit: stage library: peak memory per rank" in err
    assert "the largest part is parent block activations" in err
