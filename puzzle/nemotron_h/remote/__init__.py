"""The `trust_remote_code` files shipped inside every nemotron_h_puzzle checkpoint, and `write_remote_code`.

`configuration_nemotron_h_puzzle.py` and `modeling_nemotron_h_puzzle.py` (beside this file) import only
torch, transformers and the standard library, never puzzle: they are what a hub user runs with
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REMOTE_CODE_FILES = ("configuration_nemotron_h_puzzle.py", "modeling_nemotron_h_puzzle.py")
AUTO_MAP = {
    "AutoConfig": "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig",
    "AutoModelForCausalLM": "modeling_nemotron_h_puzzle.NemotronHPuzzleForCausalLM",
}


def write_remote_code(directory: str | Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """Copy the remote-code files into `directory` when `config` is nemotron_h_puzzle; returns the config to write.

    The returned config is `config` with `auto_map` pointing at the copied files (nemotron_h_puzzle), or
    `config` unchanged (nemotron_h: transformers has the model built in, nothing is copied).
    """
    if config.get("model_type") != "nemotron_h_puzzle":
        return dict(config)
    source = Path(__file__).parent
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(source / name, Path(directory) / name)
    return {**config, "auto_map": dict(AUTO_MAP)}
