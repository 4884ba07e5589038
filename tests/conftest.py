"""Test-session settings: one torch thread per test process, and per process a test starts.

The suite runs as `pytest -n 2` on 2-core machines; two workers with several threads each would
oversubscribe the cores, and tiny models then run several times slower. The processes the tests start
(`puzzle` commands, torchrun ranks, the demo) inherit OMP_NUM_THREADS=1 for the same reason: each would
otherwise start one OpenMP thread per core, whose spin-waits, beside the two workers and any other job on
the machine, made a quick demo run past its 600 s timeout under load (the cause, not the timeout, is fixed).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every process a test starts


@pytest.fixture(scope="module")
def hf_modules_cache(tmp_path_factory):
    """transformers copies trust_remote_code files into HF_MODULES_CACHE and imports them as the package
    `transformers_modules`, found through sys.path: use a temporary cache, with no other cache's
    `transformers_modules` on sys.path (else the package resolves there), and forget both afterwards."""
    from transformers import dynamic_module_utils

    cache = str(tmp_path_factory.mktemp("hf_modules"))
    saved_path = list(sys.path)
    saved = {name: module for name, module in sys.modules.items() if name.startswith("transformers_modules")}
    for name in saved:
        del sys.modules[name]
    sys.path[:] = [entry for entry in sys.path if not (Path(entry) / "transformers_modules").is_dir()]
    previous, dynamic_module_utils.HF_MODULES_CACHE = dynamic_module_utils.HF_MODULES_CACHE, cache
    yield cache
    dynamic_module_utils.HF_MODULES_CACHE = previous
    sys.path[:] = saved_path
    for name in [name for name in sys.modules if name.startswith("transformers_modules")]:
        del sys.modules[name]
    sys.modules.update(saved)
