"""Regenerate the local lm-eval tasks' data (puzzle/eval_tasks/*.jsonl) from this repo's own Python source.

`python benchmarks/make_next_line_task.py` reads the `.py` files under `puzzle/` at the fixed commit SOURCE_COMMIT
(through `git show`, so the items do not move as the code does) and writes ITEMS items. Each item is the last
few lines of a file up to some point (`context`), the true next line, and CHOICES - 1 lines of similar length
drawn from other files. The demo parent trains on the standard library, so these files are held out from it.
It also writes IDENTIFIER_ITEMS items of identifiers.jsonl (task puzzle_identifiers): the code up to an
identifier that the preceding lines already use, with its first PREFIX_CHARS characters, and the rest of
it to complete (a copy from the context), scored as a greedy exact match.
Deterministic: the same commit and constants give the same bytes.
"""

from __future__ import annotations

import json
import keyword
import random
import re
import subprocess
from pathlib import Path

SOURCE_COMMIT = "b068519"  # the commit the items are drawn from
ITEMS = 3000
CHOICES = 4
CONTEXT_LINES = 6
MAX_CONTEXT_CHARS = 300  # byte-level tokens: keeps a request short for the demo's small models
MIN_LINE_CHARS = 12  # a next line worth predicting: not `)` or `else:`
MAX_LINE_CHARS = 100
SEED = 37
ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "puzzle" / "eval_tasks" / "next_line.jsonl"
IDENTIFIER_ITEMS = 3000
IDENTIFIER_SEED = 38
PREFIX_CHARS = (
    4  # of the identifier, given: the model completes the rest by finding it earlier in the context
)
MIN_IDENTIFIER_CHARS = 5  # at least 1 character to complete; short names (`x`, `i`) are guessed, not copied
MAX_IDENTIFIER_CHARS = 24
IDENTIFIER_OUTPUT = ROOT / "puzzle" / "eval_tasks" / "identifiers.jsonl"
_IDENTIFIER = re.compile(r"(?<![\w.'\"])[A-Za-z_][A-Za-z0-9_]*")
_KEYWORDS = frozenset(keyword.kwlist) | {"self", "None", "True", "False"}


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


def build_identifier_items(files: dict[str, list[str]]) -> list[dict]:
    """IDENTIFIER_ITEMS items {"id", "file", "context", "identifier", "completion"}: an identifier of 5-24
    characters (no keyword, not after a '.' or in a string's first character) that the CONTEXT_LINES lines
    before it already hold; the context is the code up to it (at most MAX_CONTEXT_CHARS) and its first
    PREFIX_CHARS characters, the completion the rest of it. One item per line at most.

    The whole identifier is in the context (checked after the cut), so the task is a copy: a model that
    finds the earlier occurrence from its first characters completes it; shuffled weights complete none.
    """
    rng = random.Random(IDENTIFIER_SEED)
    positions = [
        (name, index)
        for name, lines in files.items()
        for index in range(CONTEXT_LINES, len(lines))
        if lines[index].strip() and not lines[index].lstrip().startswith("#")
    ]
    rng.shuffle(positions)
    items, seen = [], set()
    for name, index in positions:
        if len(items) == IDENTIFIER_ITEMS:
            break
        lines = files[name]
        before = "\n".join(lines[index - CONTEXT_LINES : index]) + "\n"
        candidates = [
            match
            for match in _IDENTIFIER.finditer(lines[index])
            if MIN_IDENTIFIER_CHARS <= len(match.group()) <= MAX_IDENTIFIER_CHARS
            and match.group() not in _KEYWORDS
            and re.search(rf"\b{re.escape(match.group())}\b", before)
            and match.start() > 0  # something of the line itself before it
        ]
        if not candidates:
            continue
        match = rng.choice(candidates)
        identifier = match.group()
        context = (before + lines[index][: match.start() + PREFIX_CHARS])[-MAX_CONTEXT_CHARS:]
        # the identifier must still be in the context the model sees, after the cut to MAX_CONTEXT_CHARS
        earlier = context[:-PREFIX_CHARS]
        if (context, identifier) in seen or not re.search(rf"\b{re.escape(identifier)}\b", earlier):
            continue
        seen.add((context, identifier))
        items.append(
            {
                "id": len(items),
                "file": name,
                "context": context,
                "identifier": identifier,
                "completion": identifier[PREFIX_CHARS:],
            }
        )
    return items


def _write(path: Path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    print(f"{path.relative_to(ROOT)}: {len(items)} items from {SOURCE_COMMIT}")


def main() -> None:
    """Write OUTPUT and IDENTIFIER_OUTPUT (one JSON object a line) and say how many items each holds."""
    files = source_files()
    _write(OUTPUT, build_items(files))
    _write(IDENTIFIER_OUTPUT, build_identifier_items(files))


if __name__ == "__main__":
    main()
