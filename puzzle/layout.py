"""Where each stage's output lives in a run directory: one place for the paths every stage and command use.

    RUN_DIR/
      run.resolved.yaml  the config the run started with, its paths made absolute (`puzzle run`; a
                         user's own config file, even one kept in the run directory, is never written)
      run.json           the run's manifest: each stage's status, inputs (content hashes) and outputs
      parent.json        the parent's ModelSpec (`ModelSpec.to_json`), what the cost model reads
      hardware.json      this machine's calibration for the "this-machine" cost model, measured once per
                         run (`RunLayout.hardware`) and reused by the search, `puzzle search`, the report
      importance/        activation importance of the parent (child initialisation)
      library/           BLD: library.manifest.json, library.json, block{i}/{variant file name}.safetensors
                         (`library_variant_file`: the variant id, portable)
      scores/            scoring: scores.manifest.json, scores.json
      solutions/         searches saved by the pipeline, {name}.json per budget (`puzzle search RUN_DIR`
                         writes only to --out)
      frontier.json      the Pareto frontier the solutions stage swept against each budget key of its
                         solutions (`puzzle.problem.frontier_sweep`), drawn by the report
      children/{name}/   GKD of the assembled child of solution {name}: checkpoints, history.json, weights
      exports/{name}/    the exported checkpoint of solution {name} (config.json, safetensors, puzzle.json)
      eval/{model}.json  lm-eval's results of the run's `eval.tasks` (`puzzle.run.evaluate`): parent.json,
                         {name}.assembled.json and {name}.distilled.json of each solution
      report/            `puzzle report`: report.md and its PNG plots
      logs/              one log file per process (rank), rank{r}.log
      round-{r}/         round r >= 2 of an iterative run: the same layout, its parent the previous
                         round's distilled child

A stage's output counts as present when its manifest exists: `puzzle.artifacts` writes the manifest
last, so it only ever describes complete files.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from puzzle.files import atomic_write_bytes, foreign_entries
from puzzle.spec import ModelSpec

if TYPE_CHECKING:
    from puzzle.cost.hardware import HardwareProfile

# The pipeline's stages in order (puzzle/run/, one module each; `puzzle run --until`).
STAGES = ("importance", "library", "scores", "solutions", "assemble", "distill", "export")
CONFIG_FILE = "run.resolved.yaml"
# Where runs before 0.1 saved their resolved config; read (never written) when CONFIG_FILE is missing.
LEGACY_CONFIG_FILE = "config.yaml"
CALIBRATION_FILE = "hardware.json"
RUN_MANIFEST_FILE = "run.json"
IMPORTANCE_DIR = "importance"
CHILDREN_DIR = "children"
EXPORTS_DIR = "exports"
EVAL_DIR = "eval"
REPORT_DIR = "report"
FRONTIER_FILE = "frontier.json"
LOGS_DIR = "logs"
PARENT_FILE = "parent.json"
PARENT_HASH_FILE = (
    "parent_hash.json"  # the parent's content hashes per file (`fingerprint_checkpoint`'s cache)
)
LIBRARY_DIR = "library"
SCORES_DIR = "scores"
SOLUTIONS_DIR = "solutions"
# Top-level entries a run writes (round-{r}/ too); anything else in a directory without run.json is the
# user's, and the run refuses that directory (`RunLayout.check_usable`).
_OWN_ENTRIES = frozenset(
    {
        CONFIG_FILE,
        CALIBRATION_FILE,
        RUN_MANIFEST_FILE,
        PARENT_FILE,
        PARENT_HASH_FILE,
        IMPORTANCE_DIR,
        LIBRARY_DIR,
        SCORES_DIR,
        SOLUTIONS_DIR,
        CHILDREN_DIR,
        EXPORTS_DIR,
        EVAL_DIR,
        REPORT_DIR,
        LOGS_DIR,
        "tokens",
    }
)
# The stages' manifests, as puzzle.artifacts names them (`{stage}.manifest.json`).
_LIBRARY_MANIFEST = "library.manifest.json"

# Characters every file system keeps in a name (Windows and SMB shares refuse ':', which variant ids use).
_PORTABLE_NAME = re.compile(r"[A-Za-z0-9._-]+")
_ID_WITHOUT_UNDERSCORE = re.compile(r"[A-Za-z0-9.:-]+")


def variant_file_stem(variant_id: str) -> str:
    """A portable file name (characters [A-Za-z0-9._-]) for a variant id, distinct for distinct ids.

    An id of letters, digits, '.', '-' and ':' (every id today, e.g. `moe:e4:k1:w8:s8`) has its ':' spelt
    '_' (`moe_e4_k1_w8_s8`): one to one, as such ids hold no '_'. Any other id (e.g. a float written
    `1e+16`) has every other character spelt '_' and a digest of the id appended, which keeps it apart.
    """
    if _ID_WITHOUT_UNDERSCORE.fullmatch(variant_id):
        return variant_id.replace(":", "_")
    readable = re.sub(r"[^A-Za-z0-9.-]", "_", variant_id)
    return f"{readable}.{hashlib.sha256(variant_id.encode()).hexdigest()[:12]}"


def library_variant_file(block_index: int, variant_id: str) -> str:
    """Where BLD writes a trained variant, relative to the library directory: `block{i}/{stem}.safetensors`.

    The one place library file names are made. Libraries written before names were portable used the raw
    id (`block3/moe:e4:k1:w8:s8.safetensors`); their library.json records each file, which is what is read.
    """
    return f"block{block_index}/{variant_file_stem(variant_id)}.safetensors"


_SCORES_MANIFEST = "scores.manifest.json"


class RunDirError(ValueError):
    """A run directory without the output a command needs; the message names the path and its stage."""


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory (nothing is created or read by building one)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        """Where the run saves the config it started with (resolved: absolute paths)."""
        return self.root / CONFIG_FILE

    @property
    def resolved_config(self) -> Path:
        """The saved config to read: `config`, or an older run's `config.yaml` when only that exists."""
        legacy = self.root / LEGACY_CONFIG_FILE
        return legacy if not self.config.is_file() and legacy.is_file() else self.config

    def check_usable(self) -> None:
        """RunDirError unless a run may write here: the directory is new, empty, an earlier run's (it holds
        run.json), or holds only YAML files (a config kept in its own run directory) and a run's own entries.
        A run never writes a file it does not own; this keeps it out of folders full of the user's files.
        """
        root = self.root
        if not root.exists():
            return
        if not root.is_dir():
            raise RunDirError(f"run directory {root} is a file: expected a directory")
        if self.manifest.is_file():
            return
        foreign = foreign_entries(
            root,
            lambda entry: (
                entry.name in _OWN_ENTRIES
                or entry.name.startswith(("round-", "."))
                or (entry.is_file() and entry.suffix in (".yaml", ".yml"))
            ),
        )
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise RunDirError(
                f"run directory {root} holds files that are not a puzzle run's ({shown}): choose a new or "
                "empty directory (nothing was written)"
            )

    @property
    def calibration(self) -> Path:
        """This machine's calibration of the run (`puzzle.cost.hardware.stored_calibration`)."""
        return self.root / CALIBRATION_FILE

    @property
    def parent(self) -> Path:
        return self.root / PARENT_FILE

    @property
    def parent_hash(self) -> Path:
        """The cache of the parent's content hashes (`puzzle.artifacts.fingerprint_checkpoint`)."""
        return self.root / PARENT_HASH_FILE

    @property
    def library(self) -> Path:
        """The `directory` of `puzzle.bld.build_library` / `read_library`."""
        return self.root / LIBRARY_DIR

    @property
    def scores(self) -> Path:
        """The `out_dir` of `puzzle.score.score_variants` / `load_scores`."""
        return self.root / SCORES_DIR

    @property
    def solutions(self) -> Path:
        return self.root / SOLUTIONS_DIR

    @property
    def frontier(self) -> Path:
        """The solutions stage's frontier sweep (`puzzle.problem.frontier_sweep`), read by the report."""
        return self.root / FRONTIER_FILE

    @property
    def manifest(self) -> Path:
        return self.root / RUN_MANIFEST_FILE

    @property
    def importance(self) -> Path:
        return self.root / IMPORTANCE_DIR

    @property
    def report(self) -> Path:
        return self.root / REPORT_DIR

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    def solution(self, name: str) -> Path:
        """The saved solution of the budget called `name`."""
        return self.solutions / f"{name}.json"

    def child(self, name: str) -> Path:
        """GKD's directory for the child of solution `name` (checkpoints, history, distilled weights)."""
        return self.root / CHILDREN_DIR / name

    def export(self, name: str) -> Path:
        """The exported checkpoint of solution `name`."""
        return self.root / EXPORTS_DIR / name

    def evaluation(self, model: str) -> Path:
        """lm-eval's results of `model` ("parent", "{name}.assembled", "{name}.distilled")."""
        return self.root / EVAL_DIR / f"{model}.json"

    def round(self, number: int) -> RunLayout:
        """Round `number` of an iterative run: round 1 is this directory, round r >= 2 `round-{r}/`."""
        if number < 1:
            raise ValueError(f"rounds are numbered from 1, got {number}")
        return self if number == 1 else RunLayout(self.root / f"round-{number}")

    def hardware(self, name: str | HardwareProfile) -> str | HardwareProfile:
        """Hardware `name` as this run's cost model takes it (`get_hardware` accepts both): "this-machine"
        (or an alias) is the run's stored calibration, measured and stored on first use so that every
        stage and command of the run prices with the same figures; other names and profiles as given.
        SpecError for an unknown name, RunDirError if the run directory does not exist."""
        # Late: the layout is imported by commands that never price anything.
        from puzzle.cost.hardware import HardwareProfile, hardware_key, stored_calibration

        if isinstance(name, HardwareProfile) or hardware_key(name) != "this-machine":
            return name
        self._require_root()  # never creates a run directory
        return stored_calibration(self.calibration)

    def write_parent(self, spec: ModelSpec) -> Path:
        """Record the parent's spec (atomically); the run's costs are computed from it."""
        return atomic_write_bytes(self.parent, (spec.to_json() + "\n").encode())

    def read_parent(self) -> ModelSpec:
        """The parent's spec from parent.json; RunDirError naming the file if it is missing or malformed."""
        self._require_root()
        if not self.parent.is_file():
            raise RunDirError(
                f"{self.parent} does not exist: the run records its parent's spec there "
                f"(RunLayout.write_parent); or name the parent with --parent"
            )
        try:
            return ModelSpec.from_json(self.parent.read_text())
        except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError and SpecError are ValueErrors
            raise RunDirError(f"{self.parent} is not a model spec: {error}") from None

    def require_library(self) -> Path:
        """The library directory, if BLD finished there; RunDirError naming what is missing otherwise."""
        return self._require(self.library, _LIBRARY_MANIFEST, "the BLD stage (puzzle.bld.build_library)")

    def require_scores(self) -> Path:
        """The scores directory, if scoring finished there; RunDirError naming what is missing otherwise."""
        return self._require(self.scores, _SCORES_MANIFEST, "the scoring stage (puzzle.score.score_variants)")

    def _require_root(self) -> None:
        if not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise RunDirError(f"run directory {self.root} {what}")

    def _require(self, directory: Path, manifest: str, stage: str) -> Path:
        self._require_root()
        if not (directory / manifest).is_file():
            missing = directory if not directory.is_dir() else directory / manifest
            raise RunDirError(f"{missing} does not exist: {stage} writes it (the run has not reached it)")
        return directory
