"""The pipeline: one run config, one resumable run directory, one typed call per stage (notebooks, `puzzle run`).

    run = puzzle.Run("runs/x", parent="ckpt/", data="data/", space="space.yaml", budgets=["active_params<=0.6x"])
    # or Run.from_config("run.yaml"), or Run(run_dir, config)
    importance = run.importance()            # ModelImportance   (puzzle.prune)
    lib = run.library()                      # Library           (puzzle.bld: BLD)
    scores = run.scores()                    # Scores            (puzzle.score: replace-one-block)
    best = run.search("active_params<=0.6x")[0]  # list[Solution] (puzzle.search, the run's cost model)
    child = run.assemble(best)               # HybridLM          (puzzle.assemble, its KL measured)
    child = run.distill(child)               # HybridLM          (puzzle.gkd)
    path = run.export(child)                 # Path              (puzzle.export; default exports/{name}/)
    results = run.evaluate(child)            # lm-eval's results (puzzle.eval; eval/{name}.distilled.json)
    run.all()                                # every stage of every round, as `puzzle run` does

Stages, in order (`STAGES`): importance (importance/), library (library/), scores (scores/), solutions (one
search per budget list / sweep point and `search.solutions`, saved to solutions/{name}.json as `puzzle
search --json` prints it), assemble (each solution's child and its measured KL to the parent), distill
(GKD into children/{name}/) and export (exports/{name}/); then, when the config's `eval.tasks` names lm-eval
tasks, the parent and each child assembled and distilled are evaluated on them (records `eval/{model}`,
files eval/{model}.json: `puzzle.run.evaluate`). `Run.record(stage)` is the manifest layer: a
stage's recorded outputs (dicts of file fingerprints and figures); the typed calls load their objects from
what it recorded.

Reuse, one rule for every call: the work of a call is a record in the manifest (run.json, written
atomically by rank 0) under `stages[NAME]`. NAME is the stage itself for what the run config asks (its
budgets' solutions and their children, recorded together, as `puzzle run` records them), or
`STAGE/SOLUTION` for a solution of budgets given to `search` that the config does not list (and for an
export to a path of the caller's). The record holds its status (`running`, `failed`, `done` when computed
by this invocation, `reused` when found finished), the content hash of its inputs and its outputs with
their fingerprints. The inputs are the config sections the stage reads, the fingerprints of the upstream
records it reads and the call's own arguments (budgets, an export path). A record that is finished, of
the same input hash, with its outputs unchanged on disk, is reused; anything else runs (and the record is
rewritten). Unchanged on disk means every file a stage wrote: its manifest by content hash and the files
it lists by the sha256 and stat key recorded as they were written (`puzzle.artifacts.manifest_damage`; an
export's files in its record), so a truncated, deleted or replaced file is found for the cost of a stat
per untouched file. A damaged record is redone only in its damaged part: the stage functions reuse what
is intact (BLD retrains only the variants whose files are damaged, GKD only the damaged children, the
export stage re-exports only the damaged exports); a damaged library.json, which no part can be redone
from, is a RunError naming it and the command that redoes the library. So a change reaches exactly the stages downstream of it (a new budget re-solves; the library
and scores, which do not read the budget, are reused). Objects given to a call are known by the record
they came from: a Solution by the fingerprint of its saved JSON, a model by the run.assemble / run.distill
call of this Run that returned it (its weights are not read: a model changed since is not recognised as
changed). A killed stage resumes from its last completed unit: BLD's finished waves and checkpoints,
scoring's saved variants and GKD's checkpoints live in their directories, and the stage functions reuse
them through their own manifests (`puzzle.artifacts`), as they do when called without a Run.

Distributed (torchrun): importance, BLD, scoring, measured KL and GKD run on every rank and shard their
work; the search runs on rank 0 while the others wait at a barrier (the scoring passes of
`search.context_rounds` run on every rank, between rank 0's solves); the export of a sharded child runs on
every rank, which gather each tensor in turn for rank 0 to write (a whole child: rank 0 alone). Round r >= 2 of an
iterative run (`rounds.count`) is a `Run` of its own in `round-{r}/`, whose parent is the previous round's
exported distilled child (`Run.all` chains them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from puzzle.artifacts import fingerprint_json
from puzzle.config import RunConfig, load_config, load_config_data, to_dict
from puzzle.gkd import load_distilled
from puzzle.layout import STAGES
from puzzle.ledger import DONE, RunError
from puzzle.library import Library, read_library
from puzzle.model import HybridLM
from puzzle.prune.importance import ModelImportance, load_importance
from puzzle.run import assemble as assemble_stage
from puzzle.run import distill as distill_stage
from puzzle.run import evaluate as evaluate_stage
from puzzle.run import export as export_stage
from puzzle.run import importance as importance_stage
from puzzle.run import library as library_stage
from puzzle.run import scores as scores_stage
from puzzle.run import solutions as solutions_stage
from puzzle.run.assemble import assembled
from puzzle.run.context import RunContext, slug
from puzzle.run.distill import distilled
from puzzle.run.export import export_one
from puzzle.run.solutions import context_scores, solution_bytes, solutions_inputs, solve_one
from puzzle.scores import Scores, load_scores
from puzzle.search.types import Solution
from puzzle.space import SearchSpace
from puzzle.spec import Variant

_log = logging.getLogger("puzzle.run")


def _config_from_pieces(
    run_dir: str | Path,
    parent: str | Path | Mapping[str, Any] | None,
    data: str | Path | Mapping[str, Any] | None,
    space: SearchSpace | str | Path | Mapping[str, Any] | None,
    budgets: Sequence[str],
    sections: Mapping[str, Any],
) -> RunConfig:
    """The RunConfig of `Run(run_dir, parent=..., data=..., space=..., budgets=..., **sections)`; relative
    paths are relative to the working directory. ConfigError (naming the key) as for a config file."""
    if parent is None or data is None:
        raise TypeError("Run(run_dir, parent=..., data=...): the parent checkpoint and the data are needed")
    if isinstance(budgets, str):
        budgets = [budgets]
    if isinstance(space, SearchSpace):
        space = to_dict(space)
    elif isinstance(space, Path):
        space = str(space)
    config: dict[str, Any] = {
        "run_dir": str(run_dir),
        "parent": dict(parent) if isinstance(parent, Mapping) else {"path": str(parent)},
        "data": dict(data) if isinstance(data, Mapping) else {"sources": [str(data)]},
        **sections,
    }
    if space is not None:
        config["space"] = space
    if budgets:
        config["search"] = {**sections.get("search", {}), "budgets": list(budgets)}
    return load_config_data(config, Path.cwd())


class Run(RunContext):
    """One round of a Puzzle run in `run_dir` (see the module docstring).

    Either from a validated `config` (`Run(run_dir, config)`, `Run.from_config(path)`), or from its main
    pieces by keyword, the rest defaulted as in a run config (docs/CONFIG.md):
    `Run(run_dir, parent=CHECKPOINT_DIR, data=SOURCE, space=SPACE, budgets=[...], **sections)`, where
    `parent` and `data` may also be their config sections (mappings), `space` is a `SearchSpace`, a preset name, a YAML file or an inline mapping, and
    `sections` are other config sections as mappings (`bld={"token_budget": ...}`, `seed=1`). `budgets`:
    the search's default budget list (`run.search()` without budgets, `run.all()`); a run config needs one.

    `round_number`: 1 for the run itself; r >= 2 for round r (its run_dir is `round-{r}/` and the config's
    parent the previous round's child: `Run.all` makes those). Nothing is read or written until a stage
    is called.
    """

    # Each stage's module records it (config-driven, as `puzzle run` records them), in `STAGES` order.
    RECORDERS: ClassVar[Mapping[str, Callable[[RunContext], dict[str, Any]]]] = MappingProxyType(
        {
            "importance": importance_stage.record,
            "library": library_stage.record,
            "scores": scores_stage.record,
            "solutions": solutions_stage.record,
            "assemble": assemble_stage.record,
            "distill": distill_stage.record,
            "export": export_stage.record,
        }
    )
    # How each stage's recorded outputs are checked before reuse (the frontier's file as a solution's).
    OUTPUT_CHECKS: ClassVar[Mapping[str, Callable[[RunContext, dict[str, Any]], str | None]]] = (
        MappingProxyType(
            {
                "importance": importance_stage.damage,
                "library": library_stage.damage,
                "scores": scores_stage.damage,
                "solutions": solutions_stage.damage,
                "frontier": solutions_stage.damage,
                "assemble": assemble_stage.damage,
                "distill": distill_stage.damage,
                "export": export_stage.damage,
                "eval": evaluate_stage.damage,
            }
        )
    )

    def __init__(
        self,
        run_dir: str | Path,
        config: RunConfig | None = None,
        *,
        round_number: int = 1,
        parent: str | Path | Mapping[str, Any] | None = None,
        data: str | Path | Mapping[str, Any] | None = None,
        space: SearchSpace | str | Path | Mapping[str, Any] | None = None,
        budgets: Sequence[str] = (),
        **sections: Any,
    ) -> None:
        pieces = parent is not None or data is not None or space is not None or budgets or sections
        if config is None:
            config = _config_from_pieces(run_dir, parent, data, space, budgets, sections)
        elif pieces:
            raise TypeError("Run: give either a RunConfig or its pieces (parent=, data=, ...), not both")
        super().__init__(run_dir, config, round_number)
        # The models this Run returned: model -> (solution name, "assemble" or "distill").
        self._models: weakref.WeakKeyDictionary[HybridLM, tuple[str, str]] = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(cls, path: str | Path) -> Run:
        """The run of the config file at `path` (validated, paths checked: ConfigError otherwise)."""
        config = load_config(path, check_paths=True)
        return cls(config.run_dir, config)

    def importance(self) -> ModelImportance:
        """Activation importance of the parent on importance.tokens training tokens (importance/)."""
        self.record("importance")
        return load_importance(self.layout.importance)

    def library(self) -> Library:
        """BLD of every variant of the space (library/; resumes from its checkpoints)."""
        self.record("library")
        return read_library(self.layout.library)

    def scores(self) -> Scores:
        """Replace-one-block scores of every usable library variant on held-out tokens (scores/)."""
        self.record("scores")
        return load_scores(self.layout.scores)

    def search(self, *budgets: str) -> list[Solution]:
        """The best architectures under `budgets` (texts of `puzzle search --budget`; none: the config's
        first budget list), `search.solutions` of them, best first, each saved to solutions/{name}.json
        (rank 0 solves). InfeasibleError when the budgets cannot be met."""
        texts = list(budgets) or next(iter(self.budgets().values()))
        configured = [name for name, listed in self.budgets().items() if listed == texts]
        if configured:
            entries = {n: e for n, e in self.record("solutions").items() if e["budgets"] == texts}
        else:
            name = slug(texts)
            inputs = solutions_inputs(self, {name: texts})
            entries = self.stage(f"solutions/{name}", inputs, lambda: solve_one(self, name, texts))
        problem = self.problem(texts)  # the table the saved names index
        return [Solution.from_json(self.solution_json(n), problem.table) for n in entries]

    def scores_in_context(self, name: str, own: list[Variant], wanted: list[Variant]) -> Scores:
        """`wanted` scored in the child whose blocks are `own` (a collective; cached, like the rounds, under
        solutions/context/{name}/predict-{the child's fingerprint}/, one folder per child): what
        `puzzle.context.predict_in_context` ranks other architectures from, around a child the search chose."""
        parent = self.parent(self.config.scoring.shard)
        library = read_library(self.layout.library)
        child = fingerprint_json([v.to_dict() for v in own])[:12]
        return context_scores(self, name, child, parent, library, own, wanted, "predict")

    def solution_name(self, solution: Solution) -> str:
        """The name under which this run's search saved `solution` (solutions/{name}.json); RunError for a
        Solution that no search of this run returned (it is known by the fingerprint of its JSON)."""
        # `fingerprint_file` of the file it would have been saved to.
        fingerprint = hashlib.sha256(solution_bytes(solution.to_json())).hexdigest()
        for record_name, record in self.manifest()["stages"].items():
            if record_name.split("/", 1)[0] != "solutions" or record.get("status") not in DONE:
                continue
            for name, entry in record["outputs"].items():
                if entry["fingerprint"] == fingerprint:
                    return name
        raise RunError(
            f"{self.layout.manifest}: no search of this run found this solution ({solution.names}); "
            "pass a Solution that run.search returned"
        )

    def _source(self, model: HybridLM) -> tuple[str, str]:
        """(solution name, "assemble" or "distill") of a model this Run returned; RunError otherwise."""
        if model not in self._models:
            raise RunError(
                "this model was not returned by this Run's assemble or distill: the run knows a child by the "
                "solution it was assembled from (run.assemble(solution))"
            )
        return self._models[model]

    def assemble(self, solution: Solution) -> HybridLM:
        """The child of `solution` (from `run.search`) with the library's weights; its KL to the parent on
        held-out tokens is measured and recorded (`measured`)."""
        name = self.solution_name(solution)
        assembled(self, name)
        child = self.child(name)
        self._models[child] = (name, "assemble")
        return child

    def measured(self, model: HybridLM) -> dict[str, Any]:
        """The recorded KL to the parent of the child that `model` was assembled from: `kl` (measured on
        held-out tokens) and `predicted_kl` (the search's objective), as `measured_kl` reports them."""
        name, _ = self._source(model)
        return dict(assembled(self, name)["measured"])

    def distill(self, child: HybridLM) -> HybridLM:
        """GKD of `child` (from `run.assemble`) against the parent (children/{name}/; resumes from its
        checkpoints): the distilled child, the checkpoint with the best held-out evaluation."""
        name, source = self._source(child)
        if source != "assemble":
            raise RunError(
                f"this model is the distilled child of {name!r} already; distill its assembled child"
            )

        distilled(self, name)
        model = load_distilled(self.layout.child(name), self.child(name))
        self._models[model] = (name, "distill")
        return model

    def export(self, child: HybridLM, path: str | Path | None = None) -> Path:
        """`child` (from `run.distill`, or `run.assemble` to export it undistilled) as a checkpoint at `path`
        (default: exports/{name}/) with its model card (rank 0); returns the checkpoint's directory."""
        name, source = self._source(child)
        out = self.layout.export(name) if path is None else Path(path).absolute()
        if source == "distill" and out == self.layout.export(name) and name in self.record("solutions"):
            entry = self.record("export")[name]
        else:
            if source == "distill":
                made_from = {"distill": distilled(self, name)["manifest"]}
            else:
                made_from = {"assemble": fingerprint_json(assembled(self, name))}
            inputs = {**made_from, "solution": self.solution_fp(name), "path": str(out)}
            entry = self.stage(f"export/{name}", inputs, lambda: export_one(self, name, source, out))[name]
        return self.layout.root / entry["path"]

    def evaluate(self, model: HybridLM | None = None) -> dict[str, Any]:
        """lm-eval's results dict of `model` (from `run.assemble` or `run.distill`; None: the parent) on the
        config's `eval` tasks, recorded as run.json's `eval/{model}` and eval/{model}.json ("parent",
        "{name}.assembled", "{name}.distilled") and reused like any stage's. RunError when `eval.tasks`
        is empty or the model is not one this Run returned."""
        name = evaluate_stage.PARENT if model is None else evaluate_stage.model_name(*self._source(model))
        return evaluate_stage.results(self, name)

    def run(self, until: str | None = None) -> dict[str, Any]:
        """Every stage of this round in order (up to and including `until`); returns their recorded outputs.
        A whole round (no `until`, or `until="export"`) then evaluates its models on `eval.tasks`, if any
        (returned under "eval": {model: its record entry})."""
        if until is not None and until not in STAGES:
            raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
        for stage in STAGES:
            self.record(stage)
            if stage == until:
                break
        done = {stage: self._results[stage] for stage in STAGES if stage in self._results}
        if until in (None, STAGES[-1]) and self.config.eval.tasks:
            done["eval"] = evaluate_stage.record(self)
        return done

    def all(self, until: str | None = None) -> list[Run]:
        """Every stage of every round (`rounds.count`); returns the rounds' Runs. Round r >= 2's parent is
        round r - 1's exported child of its `rounds.pick`-th solution (1 = the first)."""
        rounds = [self]
        self.run(until)
        current = self
        for number in range(2, self.config.rounds.count + 1):
            if until is not None and until != "export":
                break
            exports = current.record("export")
            names = list(exports)
            pick = self.config.rounds.pick
            if pick > len(names):
                raise RunError(f"rounds.pick = {pick}, but round {number - 1} has {len(names)} solutions")
            chosen = names[pick - 1]
            parent = current.layout.root / exports[chosen]["path"]
            _log.info(
                "round %d: parent = round %d's child %r (rounds.pick = %d) at %s",
                number,
                number - 1,
                chosen,
                pick,
                parent,
            )
            config = dataclasses.replace(
                self.config,
                parent=dataclasses.replace(self.config.parent, path=parent),
                run_dir=self.layout.round(number).root,
            )
            current.release_parent()  # the next round has a parent of its own
            current = Run(self.layout.round(number).root, config, round_number=number)
            current.run()
            rounds.append(current)
        return rounds
