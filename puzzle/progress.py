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


def _disable() -> bool | None:
    """tqdm's `disable` for this process: True off rank 0 or when silenced, False when forced, else None."""
    setting = os.environ.get("PUZZLE_PROGRESS", "").strip()
    if setting == "0" or not _is_main():
        return True
    if setting == "1":
        return False
    return None  # only on a terminal


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate over `items` with a progress bar labelled `desc` (see the module docstring for when it shows)."""
    yield from tqdm(items, desc=desc, total=total, unit=unit, disable=_disable(), leave=False)


def progress_bar(desc: str, total: int | None = None, unit: str = "it") -> tqdm:
    """A bar to drive by hand (`update(n)`, `set_postfix(...)`, `close()`): for loops whose unit is not
    one item, e.g. tokens per training step. Shown under the same rules as `progress`."""
    return tqdm(desc=desc, total=total, unit=unit, unit_scale=True, disable=_disable(), leave=False)
