"""Progress bars for long work: tqdm on the main process's terminal, silent elsewhere.

Bars show only when stderr is a terminal (tqdm's `disable=None`) and only on rank 0 under
torch.distributed; `PUZZLE_PROGRESS=0` silences them, `PUZZLE_PROGRESS=1` forces them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

from puzzle import dist

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate over `items` with a progress bar labelled `desc` (see the module docstring for when it shows)."""
    setting = os.environ.get("PUZZLE_PROGRESS", "").strip()
    if setting == "0" or not dist.is_main():
        disable: bool | None = True
    elif setting == "1":
        disable = False
    else:
        disable = None  # only on a terminal
    yield from tqdm(items, desc=desc, total=total, unit=unit, disable=disable, leave=False)
