"""Progress bars for long work: tqdm on the main process's terminal, silent elsewhere.

Bars show only when stderr is a terminal (tqdm's `disable=None`) and only on rank 0 under
torch.distributed; `PUZZLE_PROGRESS=0` silences them, `PUZZLE_PROGRESS=1` forces them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def _is_main() -> bool:
    """Rank 0, or no torch.distributed at all. A process that has not imported torch has no process
    group (torchrun's rank is then in $RANK), so torch is not imported just to ask (a library search
    needs none)."""
    if "torch" not in sys.modules:
        return os.environ.get("RANK", "0") == "0"
    from puzzle import dist

    return dist.is_main()


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate over `items` with a progress bar labelled `desc` (see the module docstring for when it shows)."""
    setting = os.environ.get("PUZZLE_PROGRESS", "").strip()
    if setting == "0" or not _is_main():
        disable: bool | None = True
    elif setting == "1":
        disable = False
    else:
        disable = None  # only on a terminal
    yield from tqdm(items, desc=desc, total=total, unit=unit, disable=disable, leave=False)
