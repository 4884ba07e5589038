"""Regenerate puzzle/eval_tasks/next_line.jsonl: next-line multiple choice from this repo's own Python source.

`python benchmarks/make_next_line_task.py` reads the `.py` files under `puzzle/` at the fixed commit SOURCE_COMMIT
(through `git show`, so the items do not move as the code does) and writes ITEMS items. Each item is the last
few lines of a file up to some point (`context`), the true next line, and CHOICES - 1 lines of similar length
drawn from other files. The demo parent trains on the standard library, so these files are held out from it.
Deterministic: the same commit and constants give the same bytes.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

SOURCE_COMMIT = "b068519"  # the commit the items are drawn from
ITEMS = 300
CHOICES = 4
CONTEXT_LINES = 6
MAX_CONTEXT_CHARS = 300  # byte-level tokens: keeps a request short for the demo's small models
MIN_LINE_CHARS = 12  # a next line worth predicting: not `)` or `else:`
MAX_LINE_CHARS = 100
SEED = 37
ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "puzzle" / "eval_tasks" / "next_line.jsonl"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def source_files() -> dict[str, list[str]]:
    """Relative path -> lines (without newlines) of every `.py` file under puzzle/ at SOURCE_COMMIT."""
    names = sorted(
        n
        for n in _git("ls-tree", "-r", "--name-only", SOURCE_COMMIT, "puzzle").splitlines()
        if n.endswith(".py")
    )
    return {name: _git("show", f"{SOURCE_COMMIT}:{name}").splitlines() for name in names}


def _usable(line: str) -> bool:
    text = line.strip()
    return MIN_LINE_CHARS <= len(text) <= MAX_LINE_CHARS and not text.startswith("#")


def build_items(files: dict[str, list[str]]) -> list[dict]:
    """ITEMS items, each {"id", "file", "context", "choices", "label"}, from a seeded shuffle."""
    rng = random.Random(SEED)
    positions = [
        (name, index)
        for name, lines in files.items()
        for index in range(CONTEXT_LINES, len(lines))
        if _usable(lines[index]) and lines[index] != lines[index - 1]
    ]
    by_file: dict[str, list[str]] = {
        n: [line for line in lines if _usable(line)] for n, lines in files.items()
    }
    rng.shuffle(positions)
    items, seen = [], set()
    for name, index in positions:
        if len(items) == ITEMS:
            break
        lines = files[name]
        answer = lines[index]
        context = "\n".join(lines[index - CONTEXT_LINES : index])[-MAX_CONTEXT_CHARS:] + "\n"
        if (context, answer) in seen:
            continue
        others = [n for n in files if n != name and by_file[n]]
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            candidate = rng.choice(by_file[rng.choice(others)])
            # similar length, so that acc cannot be won by preferring short lines alone
            if (
                candidate != answer
                and candidate not in distractors
                and abs(len(candidate) - len(answer)) <= 20
            ):
                distractors.append(candidate)
        choices = [answer, *distractors]
        rng.shuffle(choices)
        seen.add((context, answer))
        items.append(
            {
                "id": len(items),
                "file": name,
                "context": context,
                "choices": choices,
                "label": choices.index(answer),
            }
        )
    return items


def main() -> None:
    """Write OUTPUT (one JSON object a line) and say how many items it holds."""
    items = build_items(source_files())
    OUTPUT.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    print(f"{OUTPUT.relative_to(ROOT)}: {len(items)} items from {SOURCE_COMMIT}")


if __name__ == "__main__":
    main()
