"""examples/nemotron3_super/, the seed's run: its plan file is what `puzzle plan` prints for it today (so it
cannot go stale), its launch script plans the same command before it runs, and its budgets are the seed's."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from pathlib import Path

from puzzle.cli import main
from puzzle.config import load_config
from puzzle.cost.hardware import get_hardware

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "nemotron3_super"
PLAN_ARGS = ["--gpus", "64", "--hardware", "h100-80gb"]


def test_the_plan_file_is_what_puzzle_plan_prints_for_the_config():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(EXAMPLE / "config.yaml"), *PLAN_ARGS]) == 0
    assert (EXAMPLE / "plan-64xH100.txt").read_text() == out.getvalue(), (
        "regenerate it: puzzle plan examples/nemotron3_super/config.yaml --gpus 64 --hardware h100-80gb "
        "> examples/nemotron3_super/plan-64xH100.txt"
    )


def test_the_launch_script_plans_the_config_on_its_gpus_then_runs_it_on_every_rank():
    script = EXAMPLE / "launch.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)  # it parses
    text = script.read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1))
    assert nodes * gpus == int(PLAN_ARGS[1])  # the job is the plan file's 64 GPUs
    assert "CONFIG=${1:-examples/nemotron3_super/config.yaml}" in text
    (plan,) = [line for line in text.splitlines() if line.startswith("puzzle plan ")]
    assert plan == 'puzzle plan "$CONFIG" --gpus $((NODES * GPUS_PER_NODE)) ' + " ".join(PLAN_ARGS[2:])
    assert text.rstrip().endswith('-m puzzle run "$CONFIG"')


def test_the_budgets_are_the_seeds_throughput_at_speed_on_8xb200_and_8_million_token_requests_on_an_h100():
    config = load_config(EXAMPLE / "config.yaml")
    assert config.hardware.profile == "8xb200" and config.hardware.recipe == "nvfp4"
    (limits,) = config.round_limits(0)
    throughput, memory = limits
    speed = config.hardware.scenarios["out_64k"]
    assert throughput.text == "throughput_at_speed[out_64k]>=2.03x"
    assert (speed.prompt_tokens, speed.generated_tokens, speed.user_speed) == (8192, 65536, 500.0)
    assert speed.recipe == speed.compute_dtype == "nvfp4"
    million = config.hardware.scenarios["million_h100"]
    assert million.batch_size == 8 and million.prompt_tokens + million.generated_tokens == 1_000_000
    assert (million.recipe, million.kv_dtype) == ("nvfp4", "fp8")
    # memory_bytes at that scenario <= usable memory of one H100: exactly concurrent_requests >= 8 there.
    usable = config.hardware.memory_fraction * get_hardware("h100-80gb").memory_bytes
    assert memory.key == "memory_bytes" and memory.value == int(usable)
