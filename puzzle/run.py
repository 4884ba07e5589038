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
    run.all()                                # every stage of every round, as `puzzle run` does

Stages, in order (`STAGES`): importance (importance/), library (library/), scores (scores/), solutions (one
search per budget list / sweep point and `search.solutions`, saved to solutions/{name}.json as `puzzle
search --json` prints it), assemble (each solution's child and its measured KL to the parent), distill
(GKD into children/{name}/) and export (exports/{name}/). `Run.record(stage)` is the manifest layer: a
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

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# Every stage this module drives, imported here and only here (a name that moves moves in one place).
from puzzle import dist, hostmem, nemotron_h, shard
from puzzle.artifacts import (
    DamagedOutputError,
    checkpoint_hashes,
    file_digest,
    fingerprint_file,
    fingerprint_json,
    fingerprint_model,
    loaded_fingerprint,
    manifest_fingerprint,
    read_hash_cache,
    write_hash_cache,
)
from puzzle.assemble import assemble as assemble_child
from puzzle.assemble import measured_kl
from puzzle.bld import build_library
from puzzle.blocks import build_block
from puzzle.config import RunConfig, dump_config, load_config, load_config_data, to_dict
from puzzle.context import context_rounds, limit_changes
from puzzle.cost.hardware import profile_to_json
from puzzle.cost.serving import CostModel
from puzzle.data import TokenData, tokenizer_files
from puzzle.export import export as export_checkpoint
from puzzle.files import atomic_write_bytes
from puzzle.gkd import distill as distill_child
from puzzle.gkd import load_distilled
from puzzle.layout import STAGES, RunDirError, RunLayout
from puzzle.ledger import DONE, Ledger, RunError, peak_rss_mib
from puzzle.library import Library, read_library
from puzzle.model import HybridLM
from puzzle.plan import scoring_memory, scoring_wave_size
from puzzle.problem import (
    RunCandidates,
    RunProblem,
    frontier_budgets,
    frontier_sweep,
    rerank_by_measurement,
    run_problem,
)
from puzzle.prune.importance import ModelImportance, importance_for, load_importance
from puzzle.score import score_variants
from puzzle.scores import Scores, load_scores
from puzzle.search import search, search_k
from puzzle.search.types import Solution
from puzzle.settings import ScoreSettings
from puzzle.space import SearchSpace
from puzzle.spec import BlockSpec, ModelSpec, Variant

if TYPE_CHECKING:
    from puzzle.search.budget import DeploymentLimit

# run.json's parent record: how its fingerprint was made (`Run.parent_fingerprint`). Records without it
# (earlier versions) hold `fingerprint_model` of the loaded parent.
PARENT_SCHEME = "checkpoint-files-1"

_log = logging.getLogger(__name__)


def _slug(budgets: list[str]) -> str:
    """A file name for a budget list: `active_params<=0.75x` -> `active_params-le-0.75x`."""
    text = "+".join(budgets).replace("<=", "-le-").replace(">=", "-ge-")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "solution"


def _solution_bytes(payload: dict[str, Any]) -> bytes:
    """A solution's file, solutions/{name}.json: `Solution.to_json` as `puzzle search --json` prints it."""
    return (json.dumps(payload, indent=2) + "\n").encode()


def _write_if_changed(path: Path, content: bytes) -> None:
    """Write `path` atomically unless it already holds `content` (a rerun leaves finished files alone)."""
    if not (path.is_file() and path.read_bytes() == content):
        atomic_write_bytes(path, content)


def _on_main(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`work()` on rank 0 while the other ranks wait; its outputs on every rank. An exception on rank 0 is
    raised there as it is and on the other ranks as a RuntimeError naming it (no rank waits forever)."""
    outputs: dict[str, Any] = {}
    failure: str | None = None
    error: BaseException | None = None
    if dist.is_main():
        try:
            outputs = work()
        except Exception as caught:  # re-raised below, once every rank knows
            error, failure = caught, f"{type(caught).__name__}: {caught}"
    failure = dist.broadcast_object(failure)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"rank 0 failed: {failure}")
    return dist.broadcast_object(outputs)


def _search_on_main(problem: RunProblem, options: Any) -> Solution:
    """`search` of `problem` on rank 0 (`_on_main`), its Solution on every rank."""
    table, limits, rules = problem.table, problem.problem.limits, problem.problem.rules
    return _on_main(lambda: {"solution": search(table, limits, rules, options)})["solution"]


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


class Run:
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
        self.layout = RunLayout(Path(run_dir).absolute())
        self.config = config
        self.round_number = round_number
        # run.json and the reuse rule; the progress lines name the round in an iterative run.
        label = f"round {round_number}: " if config.rounds.count > 1 else ""
        self.ledger = Ledger(self.layout, label)
        self._parent_fp: str | None = None
        self._parent_scheme: str | None = None
        self._parent_hashes: dict[str, Any] | None = None  # the content-hash cache to write (rank 0)
        self._parent: HybridLM | None = None  # the one loaded parent of this process (`parent()`)
        self._mixer_fps: tuple[str, dict[Variant, str]] | None = None  # (library manifest hash, per variant)
        self._parent_mode = (
            "none"  # how it is laid out: "none" (whole), "fsdp" or "hsdp" (sharded from the files)
        )
        self._data: Any = None
        self._results: dict[str, Any] = {}
        # Stage -> what it resumed from checkpoints (BLD waves, GKD children), for its `done` line.
        self._resumed: dict[str, list[str]] = {}
        self._prepared = False
        self._budgets_checked = False
        # The models this Run returned: model -> (solution name, "assemble" or "distill").
        self._models: weakref.WeakKeyDictionary[HybridLM, tuple[str, str]] = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(cls, path: str | Path) -> Run:
        """The run of the config file at `path` (validated, paths checked: ConfigError otherwise)."""
        config = load_config(path, check_paths=True)
        return cls(config.run_dir, config)

    def check_run_dir(self) -> None:
        """RunError unless the run directory may be written (`RunLayout.check_usable`: new, empty, an earlier
        run's, or holding only YAML configs); `puzzle run` calls it before anything is written."""
        try:
            self.layout.check_usable()
        except RunDirError as error:
            raise RunError(str(error)) from None

    def check_budgets(self, parent: ModelSpec) -> None:
        """Raise InfeasibleError (the search's message) when no architecture of the space meets a budget of
        this round, before anything is trained: the search over every variant of the space, all scored 0.
        Spaces with importance-based widths (profiles) are checked only by the search itself."""
        space = self.config.search_space()
        if any(kind.profiles for kind in space.kinds.values()) or any(
            o.space is not None and o.space.profiles for o in space.overrides
        ):
            return
        variants: list[list[BlockSpec]] = [[block] for block in parent.blocks]
        for index, listed in space.all_variants(parent).items():
            variants[index] += [v.spec for v in listed if v.spec != parent.blocks[index]]
        candidates = RunCandidates(parent, variants, [[0.0] * len(v) for v in variants])
        for limits in self.budget_limits().values():
            problem = self._problem(limits, cost_model=self.cost_model(store=False), candidates=candidates)
            search(problem.table, problem.problem.limits, problem.problem.rules, self.config.search.solver)
        self._budgets_checked = True

    def _check_budgets_up_front(self) -> None:
        """`check_budgets` on the parent's config.json, once per Run, before a stage reads data or writes
        anything: an unmeetable budget fails in seconds, not after importance, BLD and scoring (as `puzzle
        run` checks it). The training stages call it first; a Run that already checked (`puzzle run`, the
        demo) does not check again."""
        if not self._budgets_checked:
            self.check_budgets(self.config.validate_paths())

    # -- the manifest -----------------------------------------------------------------------------------

    def manifest(self) -> dict[str, Any]:
        """run.json as it is on disk (an empty manifest before the first stage)."""
        return self.ledger.manifest()

    # -- setup ------------------------------------------------------------------------------------------

    def parent_fingerprint(self) -> str:
        """The parent's fingerprint, from its files, never loading it: `puzzle.artifacts.fingerprint_checkpoint`
        (config.json, each safetensors file's header, size and content hash) with the dtype it is loaded
        in. The content hashes are computed once, by every rank in parallel, and cached in
        RUN_DIR/parent_hash.json per file (path, size, mtime, ctime, inode): a rerun reads headers only.

        A run directory of an earlier version recorded `fingerprint_model` of the loaded parent (no
        `scheme` in run.json's parent record): that fingerprint is kept while the parent's files are those
        it was computed from (`_parent_files`), or while a load of the parent still gives it, so that the
        stages' outputs keyed by it are reused."""
        if self._parent_fp is None:
            recorded = self.manifest().get("parent", {})
            legacy = recorded.get("fingerprint") and recorded.get("scheme") is None
            # An earlier version's record: the same files, or else the same loaded weights (loads it).
            if legacy and (
                recorded.get("files") == self._parent_files()
                or fingerprint_model(self.parent()) == recorded["fingerprint"]
            ):
                self._parent_fp = str(recorded["fingerprint"])
            else:
                self._parent_fp = self._files_fingerprint()
                self._parent_scheme = PARENT_SCHEME
        return self._parent_fp

    def _files_fingerprint(self) -> str:
        """`loaded_fingerprint` of the parent's checkpoint (content hashes from RUN_DIR/parent_hash.json
        where current) and of the dtype a load gives (for "auto" its structure built on the meta device:
        headers only); the cache to write is kept for `_prepare` (a run directory is written only once
        checked)."""
        path = self.config.parent.path
        cached = read_hash_cache(self.layout.parent_hash) if dist.is_main() else None
        checkpoint, self._parent_hashes = checkpoint_hashes(path, cached)
        if self.config.parent.dtype == "auto":  # the checkpoint's: that of its embeddings
            loaded = nemotron_h.load(path, device="meta").embeddings.weight.dtype
        else:
            loaded = getattr(torch, self.config.parent.dtype)
        return loaded_fingerprint(checkpoint, loaded)

    def _parent_files(self) -> str:
        """A key of the parent's files as they are now: name, size and modification time of its config and
        weight files, and the dtype it is loaded in (a rewritten or replaced file changes it)."""
        folder = self.config.parent.path
        entries = [
            [path.name, stat.st_size, stat.st_mtime_ns]
            for path in sorted(folder.iterdir())
            if path.suffix in (".safetensors", ".json") and path.is_file() and (stat := path.stat())
        ]
        return fingerprint_json({"files": entries, "dtype": self.config.parent.dtype})

    def _prepare(self) -> None:
        """Check the directory is usable and belongs to this parent, then write run.resolved.yaml,
        parent.json and the manifest."""
        if self._prepared:
            return
        # Before the parent loads: freed gathers and gradients go back to the system (puzzle.hostmem).
        hostmem.return_freed_memory()
        _log.info("baseline: peak resident memory %.1f MiB (before the parent loads)", peak_rss_mib())
        self.check_run_dir()
        parent_dir = self.config.parent.path.resolve()
        root = self.layout.root.resolve()
        if root == parent_dir or parent_dir in root.parents:
            raise RunError(f"run directory {self.layout.root} is inside the parent checkpoint {parent_dir}")
        fingerprint = self.parent_fingerprint()
        data = self.manifest()
        recorded = data.get("parent", {}).get("fingerprint")
        if recorded is not None and recorded != fingerprint:
            raise RunError(
                f"{self.layout.manifest}: this run directory was made from another parent "
                f"({data['parent'].get('path')}, fingerprint {recorded[:12]}), not {parent_dir} "
                f"(fingerprint {fingerprint[:12]}); choose another run_dir"
            )
        if dist.is_main():
            self.layout.root.mkdir(parents=True, exist_ok=True)
            # Paths made absolute (relative ones are relative to the working directory by now), so that
            # the saved config reads back the same from inside the run directory (`puzzle search RUN_DIR`).
            # Under a name of our own: the user's config may live in this directory too.
            resolved = load_config_data(self.config.to_dict(), Path.cwd())
            _write_if_changed(self.layout.config, dump_config(resolved).encode())
            spec = self.config.validate_paths()  # the parent's spec, from its config.json
            if not (self.layout.parent.is_file() and self.layout.read_parent() == spec):
                self.layout.write_parent(spec)
            if self._parent_hashes is not None:
                write_hash_cache(self.layout.parent_hash, self._parent_hashes)
            data["parent"] = {
                "path": str(parent_dir),
                "fingerprint": fingerprint,
                "files": self._parent_files(),
            }
            if self._parent_scheme is not None:
                data["parent"]["scheme"] = self._parent_scheme
            data["round"] = self.round_number
            self.ledger.write(data)
        dist.barrier()
        self._prepared = True

    def parent(self, mode: str | None = None) -> HybridLM:
        """The parent, loaded once per process (`load_parent`) and shared by every stage of this Run.

        No stage changes its weights: importance only hooks it, BLD and scoring train and score their own
        modules (each variant initialised from a copy of its parent block), assembly copies the blocks it
        keeps and GKD trains the child beside it as a frozen teacher. `mode`: the asking stage's FSDP mode
        ("fsdp" or "none", its settings' `shard`); None takes the parent as it is loaded (assembly and the
        measured KL gather what they copy or read from a sharded parent, a unit at a time). A stage whose
        mode asks for another layout gets the parent loaded anew in it, and the old copy is dropped:
        "none" the whole parent on every rank, "fsdp" / "hsdp" over several ranks a parent sharded from the
        files. `release_parent` drops it."""
        wanted = None if mode is None else (mode if shard.active(mode) else "none")
        if self._parent is not None and wanted is not None and wanted != self._parent_mode:
            self.release_parent()
        if self._parent is None:
            self._parent_mode = wanted or "none"
            self._parent = self.load_parent(self._parent_mode)
        return self._parent

    def release_parent(self) -> None:
        """Forget the loaded parent (its memory is freed once no child or caller holds it)."""
        self._parent = None

    def load_parent(self, mode: str = "none") -> HybridLM:
        """A fresh copy of the parent, as the stages load it (BLD and GKD may shard the model they are given;
        the library's parent fingerprint matches it).

        `mode`: the FSDP mode of the stage that asks ("fsdp" or "none", its settings' `shard`). Where it
        shards (`puzzle.shard.active`: "fsdp" and more than one rank) the parent is loaded sharded from the
        files, as `puzzle.shard.shard_parent` shards it, and no rank ever holds all of it; the stage's own
        `shard_parent` then leaves it as it is. Otherwise (one rank, or "none") every rank loads all of it.
        Assembly and the measured KL take the parent as it was last loaded; the fingerprint reads the files.
        """
        dtype = None if self.config.parent.dtype == "auto" else self.config.parent.dtype
        sharded = shard.active(mode)
        model = nemotron_h.load(
            self.config.parent.path, dtype=dtype, device=dist.device(), shard=mode if sharded else False
        )
        if sharded:
            _log.info(
                "parent loaded sharded over %d ranks: this rank holds %d of its %d parameter elements",
                dist.world_size(),
                shard.local_numel(model),
                sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the whole tensor's
            )
        return model.eval().requires_grad_(False)

    @property
    def data(self) -> Any:
        """The run's TokenData (tokenised once, cached in data.cache_dir or RUN_DIR/tokens)."""
        if self._data is None:
            # Token files need no tokenizer: the parent's is used when it has one (it bounds the ids).
            tokenizer = self.config.tokenizer_dir
            if self.config.tokenizer is None and not tokenizer_files(tokenizer):
                tokenizer = None
            kwargs = self.config.data.token_data_kwargs(tokenizer)
            if kwargs["cache_dir"] is None:
                kwargs["cache_dir"] = self.layout.root / "tokens"
            self._data = TokenData.load(**kwargs)
        return self._data

    def held_out_batches(self) -> list[torch.Tensor]:
        """The held-out batches every stage measures on (scoring, measured KL, GKD's evaluations): batches of
        data.eval_batch_size, up to data.held_out_tokens (global, int64)."""
        settings = self.config.data
        split = self.data.held_out
        per_batch = settings.eval_batch_size * split.seq_len
        count = len(split) // settings.eval_batch_size
        if settings.held_out_tokens is not None:
            count = min(count, math.ceil(settings.held_out_tokens / per_batch))
        stream = split.batches(settings.eval_batch_size, self.config.seed, rank=0, world=1, epochs=1)
        return [batch for _, batch in zip(range(count), stream)]

    def _held_out_key(self) -> str:
        settings = self.config.data
        return fingerprint_json(
            {
                "split": self.data.held_out.fingerprint(),
                "batch": settings.eval_batch_size,
                "tokens": settings.held_out_tokens,
                "seed": self.config.seed,
            }
        )

    # -- the record runner: the one reuse rule (module docstring) ------------------------------------------

    def _stage(
        self, name: str, inputs: dict[str, Any], compute: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """Record `name` (a stage, or STAGE/SOLUTION) through the ledger's reuse rule (`Ledger.run`), once the
        run directory is prepared; its outputs, kept for `record`."""
        self._prepare()
        stage = name.split("/", 1)[0]
        outputs = self.ledger.run(name, inputs, compute, resumed=lambda: self._resumed.pop(stage, []))
        self._results[name] = outputs
        return outputs

    def record(self, stage: str) -> dict[str, Any]:
        """The manifest layer: the recorded outputs of `stage` (one of `STAGES`) for what the run config asks,
        running it (and what it needs) first unless this Run has. Dicts of fingerprints and figures: a
        solution's file and objective, a child's measured KL, GKD's first and last evaluations, an export's
        path (relative to the run directory)."""
        if stage not in self._results:
            if stage not in _RECORDERS:
                raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
            _RECORDERS[stage](self)
        return self._results[stage]

    _outputs = record

    def _per_solution(
        self, stage: str, name: str, inputs: Callable[[], dict[str, Any]], compute: Callable[[], Any]
    ) -> dict[str, Any]:
        """Stage `stage`'s record of solution `name`: the config's stage when `name` is one of its solutions
        (recorded together, as `puzzle run` does), else a record of its own, STAGE/NAME, of `inputs()`."""
        if name in self.record("solutions"):
            return self.record(stage)[name]
        return self._stage(f"{stage}/{name}", inputs(), lambda: {name: compute()})[name]

    # -- importance, library, scores ----------------------------------------------------------------------

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

    def _record_importance(self) -> dict[str, Any]:
        self._check_budgets_up_front()
        settings = self.config.importance
        inputs = {
            "parent": self.parent_fingerprint(),
            "data": self.data.train.fingerprint(),
            "settings": to_dict(settings),
            "seed": self.config.seed,
        }

        def compute() -> dict[str, Any]:
            importance_for(
                self.parent(settings.shard),  # every rank runs its own batches (on its shards under fsdp)
                self._calibration,
                self.layout.importance,
                linear_fit=settings.linear_fit,
                linear_fit_every=settings.linear_fit_every,
                parent_fp=self.parent_fingerprint(),
            )
            return {"manifest": self._manifest_fp(self.layout.importance, "importance")}

        return self._stage("importance", inputs, compute)

    def _calibration(self) -> Iterator[torch.Tensor]:
        settings = self.config.importance
        split = self.data.train
        count = max(1, math.ceil(settings.tokens / (settings.batch_size * split.seq_len)))
        stream = split.batches(settings.batch_size, self.config.seed, rank=0, world=1)
        # On the model's device: collect_importance runs the batches as given.
        return (batch.to(dist.device()) for _, batch in zip(range(count), stream))

    @staticmethod
    def _manifest_fp(directory: Path, stage: str) -> str:
        return manifest_fingerprint(directory / f"{stage}.manifest.json")

    def _variants(self, parent: HybridLM) -> dict[int, list[Variant]]:
        return self.config.search_space().all_variants(parent.spec, load_importance(self.layout.importance))

    def _record_library(self) -> dict[str, Any]:
        self._check_budgets_up_front()
        upstream = self.record("importance")
        inputs = {
            "parent": self.parent_fingerprint(),
            "importance": upstream["manifest"],
            "space": to_dict(self.config.search_space()),
            "data": self.data.train.fingerprint(),
            "held_out": self._held_out_key(),
            "batch_size": self.config.data.batch_size,
            "bld": to_dict(self.config.bld),
            "seed": self.config.seed,
            "world": dist.world_size(),
        }

        def compute() -> dict[str, Any]:
            parent = self.parent(self.config.bld.shard)
            split, batch = self.data.train, self.config.data.batch_size
            with self._repair_command(self.layout.library):
                library = self._build_library(parent, split, batch)
            self._resumed["library"] = [
                f"wave {number + 1} from step {step}" for number, step in library.resumed.items()
            ]
            return {"manifest": self._manifest_fp(self.layout.library, "library")}

        return self._stage("library", inputs, compute)

    def _build_library(self, parent: HybridLM, split: Any, batch: int) -> Library:
        return build_library(
            parent,
            self._variants(parent),
            lambda: split.batches(batch, self.config.seed, rank=0, world=1),
            self.held_out_batches(),
            load_importance(self.layout.importance),
            self.config.bld,
            self.layout.library,
            data_fingerprint=fingerprint_json([split.fingerprint(), batch, self.config.seed]),
            parent_fp=self.parent_fingerprint(),
        )

    @contextlib.contextmanager
    def _repair_command(self, folder: Path) -> Iterator[None]:
        """A damaged output that its stage cannot redo in part (`DamagedOutputError`) as a RunError (`puzzle
        run` exits 2) of one line: the file, and the command that redoes the stage (its folder removed,
        the run resumed from this run's saved config)."""
        try:
            yield
        except DamagedOutputError as error:
            root = self.layout.root.parent if self.round_number > 1 else self.layout.root
            config = root / self.layout.config.name
            raise RunError(f"{error}; to redo it: rm -r {folder} && puzzle run {config}") from None

    def _record_scores(self) -> dict[str, Any]:
        self._check_budgets_up_front()
        upstream = self.record("library")
        inputs = {
            "library": upstream["manifest"],
            "held_out": self._held_out_key(),
            "scoring": to_dict(self.config.scoring),
        }

        def compute() -> dict[str, Any]:
            parent = self.parent(self.config.scoring.shard)
            library = read_library(self.layout.library)
            usable = [v for v, r in library.results.items() if r.status != "failed"]
            self._score(parent, library, usable, self.layout.scores)
            return {"manifest": self._manifest_fp(self.layout.scores, "scores")}

        return self._stage("scores", inputs, compute)

    @staticmethod
    def _mixer_source(parent: HybridLM, library: Library) -> Callable[[Variant], torch.nn.Module | None]:
        """The scorer's mixers of the library's variants, loaded on demand (None: the parent's own block)."""
        hidden, eps = parent.spec.hidden_size, parent.spec.norm_eps

        def mixer(variant: Variant) -> torch.nn.Module | None:
            result = library.results.get(variant)
            if result is None or result.status == "parent":
                return None
            if result.status == "noop":
                return build_block(variant.spec, hidden).to(dist.device())
            module = library.load_mixer(variant, hidden, eps)
            return module.to(device=dist.device(), dtype=parent.embeddings.weight.dtype)

        return mixer

    def _score(
        self, parent: HybridLM, library: Library, variants: list[Variant], out: Path, **context: Any
    ) -> Scores:
        """`score_variants` of `variants` into `out` with this run's scoring settings and held-out tokens
        (the scores stage, and each round of scores in context with `context=` the child)."""
        return score_variants(
            parent,
            variants,
            self._mixer_source(parent, library),
            self.held_out_batches(),
            out,
            self._scoring_settings(parent, variants),
            data_fingerprint=self._held_out_key(),
            mixer_fingerprints=self._mixer_fingerprints(library),
            parent_fp=self.parent_fingerprint(),
            **context,
        )

    def _scoring_settings(self, parent: HybridLM, variants: list[Variant]) -> ScoreSettings:
        """The run's scoring settings, `variants_per_wave: auto` resolved from the plan (`puzzle.plan.
        scoring_wave_size`: the most variants whose planned peak per rank fits `scoring_memory`, the CUDA
        device's or else this machine's share, times hardware.memory_fraction), logged with why."""
        settings = self.config.scoring
        if settings.variants_per_wave != "auto":
            return settings
        by_block: dict[int, list[Variant]] = {}
        for variant in variants:
            by_block.setdefault(variant.block_index, []).append(variant)
        memory, where = scoring_memory(self.config)  # on the CPU: this machine's, not a GPU profile's
        found = scoring_wave_size(
            self.config,
            parent.spec,
            dist.world_size(),
            memory,
            variants=by_block,
            checkpoint=nemotron_h.read_config(self.config.parent.path),
        )
        size = int(dist.broadcast_object(found.size))  # every rank runs the same waves (collectives)
        _log.info("scores: variants_per_wave auto -> %d: %s of %s", size, found.reason, where)
        return dataclasses.replace(settings, variants_per_wave=size)

    def _mixer_fingerprints(self, library: Library) -> dict[Variant, str]:
        """Each usable variant's status, file and file hash: read once per library manifest (every round of
        scores in context would otherwise hash every variant file again)."""
        key = self._manifest_fp(self.layout.library, "library")
        if self._mixer_fps is None or self._mixer_fps[0] != key:

            def file_fp(result: Any) -> str | None:
                return (
                    None if result.file is None else fingerprint_file(Path(library.directory) / result.file)
                )

            fingerprints = {
                v: fingerprint_json([r.status, r.file, file_fp(r)])
                for v, r in library.results.items()
                if r.status != "failed"
            }
            self._mixer_fps = (key, fingerprints)
        return self._mixer_fps[1]

    # -- the search -----------------------------------------------------------------------------------------

    def budgets(self) -> dict[str, list[str]]:
        """{solution name: budget texts} of this round (one per budget list / sweep point)."""
        return {name: [limit.text for limit in limits] for name, limits in self.budget_limits().items()}

    def budget_limits(self) -> dict[str, list[DeploymentLimit]]:
        """{solution name: budgets} of this round as the config read them (`RunConfig.round_limits`), the
        objects the search takes."""
        names: dict[str, list[DeploymentLimit]] = {}
        for limits in self.config.round_limits(self.round_number - 1):
            name = _slug([limit.text for limit in limits])
            while name in names:
                name += "_"
            names[name] = limits
        return names

    def cost_model(self, *, store: bool = True) -> CostModel:
        """The search's cost model of this run, from its `hardware` settings. "this-machine" is the run's
        calibration (`RunLayout.hardware`: RUN_DIR/hardware.json, measured and stored on first use), so
        the search, `puzzle search RUN_DIR`, `puzzle report` and the demo price with the same figures.
        `store=False` (`check_budgets`, before the run directory is checked) uses a stored calibration
        but measures without storing one."""
        cost_model = self.config.hardware
        if store or self.layout.calibration.is_file():
            cost_model = dataclasses.replace(cost_model, profile=self.layout.hardware(cost_model.profile))
        return cost_model

    def _problem(
        self,
        budgets: Sequence[str | DeploymentLimit],
        *,
        cost_model: CostModel | None = None,
        candidates: RunCandidates | None = None,
    ) -> RunProblem:
        """The search problem of this run under `budgets` (texts, or the config's parsed `DeploymentLimit`s),
        with the run's search settings: the one place this module reads budgets through `puzzle.search`
        (`puzzle search RUN_DIR` builds the same)."""
        search_settings = self.config.search
        return run_problem(
            self.layout,
            list(budgets),
            objective=search_settings.objective,
            cost_model=cost_model or self.cost_model(),
            keep_blocks=search_settings.keep_blocks,
            same_attributes=search_settings.same_attributes,
            shared_state_size=search_settings.shared_state_size,
            candidates=candidates,
        )

    def search(self, *budgets: str) -> list[Solution]:
        """The best architectures under `budgets` (texts of `puzzle search --budget`; none: the config's
        first budget list), `search.solutions` of them, best first, each saved to solutions/{name}.json
        (rank 0 solves). InfeasibleError when the budgets cannot be met."""
        texts = list(budgets) or next(iter(self.budgets().values()))
        configured = [name for name, listed in self.budgets().items() if listed == texts]
        if configured:
            entries = {n: e for n, e in self.record("solutions").items() if e["budgets"] == texts}
        else:
            name = _slug(texts)
            inputs = self._solutions_inputs({name: texts})
            entries = self._stage(f"solutions/{name}", inputs, lambda: self._solve_one(name, texts))
        problem = self._problem(texts)  # the table the saved names index
        return [Solution.from_json(self._solution_json(n), problem.table) for n in entries]

    def _solutions_inputs(self, budgets: dict[str, list[str]]) -> dict[str, Any]:
        """The inputs of a search record under `budgets` ({name: texts}); stores the run's calibration."""
        search_settings = self.config.search
        inputs = {
            "library": self.record("library")["manifest"],
            "scores": self.record("scores")["manifest"],
            "budgets": budgets,
            "search": to_dict(dataclasses.replace(search_settings, budgets=(), sweep=None)),
            "hardware": to_dict(self.config.hardware),
        }
        self._rerank_inputs(inputs)
        if search_settings.context_rounds:  # scores in context read the held-out tokens and score
            inputs.update(held_out=self._held_out_key(), scoring=to_dict(self.config.scoring))
        else:  # off: the inputs of the runs made before the key existed
            inputs["search"].pop("context_rounds")
        if not search_settings.context_changes:  # likewise
            inputs["search"].pop("context_changes")
        self._prepare()  # the calibration is stored in the checked run directory
        if dist.is_main():
            self.cost_model()  # rank 0 measures and stores this machine's calibration once, if absent
        dist.barrier()
        device = self.cost_model().profile
        if not isinstance(device, str):  # this machine's calibration: new figures re-solve
            inputs["calibration"] = profile_to_json(device)
        return inputs

    def _record_solutions(self) -> dict[str, Any]:
        inputs = self._solutions_inputs(self.budgets())
        outputs = self._stage("solutions", inputs, self._solve)
        # The frontier is a record of its own: the solution names stay the solutions stage's only outputs.
        frontier_inputs = {
            **inputs,
            "solutions": {name: entry["fingerprint"] for name, entry in outputs.items()},
        }
        self._stage("frontier", frontier_inputs, lambda: _on_main(lambda: self._sweep_frontier(outputs)))
        return outputs

    def _sweep_frontier(self, solutions: Mapping[str, Any]) -> dict[str, Any]:
        """The Pareto frontier against the budget keys of the config's solutions -> frontier.json, so that
        the report draws it without solving (`puzzle.problem.frontier_sweep`)."""
        cost_model = self.cost_model()
        problem = self._problem(frontier_budgets(cost_model), cost_model=cost_model)
        saved = {name: self._solution_json(name) for name in solutions}
        payload = frontier_sweep(problem, saved, self.config.search.solver)
        atomic_write_bytes(self.layout.frontier, (json.dumps(payload, indent=2) + "\n").encode())
        path = self.layout.frontier
        return {"frontier": {"file": path.name, "fingerprint": fingerprint_file(path)}}

    def _solve(self) -> dict[str, Any]:
        """Every budget list of the config solved and saved: {solution name: its record} (collective)."""
        saved: dict[str, Any] = {}
        for name, limits in self.budget_limits().items():
            saved.update(self._solve_one(name, limits))
        return saved

    def _solve_one(self, name: str, budgets: Sequence[str | DeploymentLimit]) -> dict[str, Any]:
        """The search under `budgets` (texts or the config's parsed budgets) -> solutions/{name}.json (and
        {name}-2, ... for `search.solutions`). Collective: rank 0 solves and saves; every rank takes part in
        the scoring of `search.context_rounds` (`_in_context`) and in measuring the candidates of
        `search.rerank` (`_rerank`)."""
        settings = self.config.search
        texts = [budget if isinstance(budget, str) else budget.text for budget in budgets]
        problem = self._problem(budgets)

        def first() -> dict[str, Any]:
            for note in problem.notes:
                _log.warning("search %s: %s", name, note)
            limits, rules = problem.problem.limits, problem.problem.rules
            wanted = max(settings.solutions, settings.rerank)
            return {
                "found": search_k(problem.table, limits, rules, settings.solver, wanted, settings.min_diff)
            }

        found = _on_main(first)["found"]
        found, context = self._in_context(name, budgets, problem, found)
        payloads, reranked = self._rerank(name, [solution.to_json() for solution in found])
        return _on_main(lambda: self._save_solutions(name, texts, payloads, reranked, context))

    def _save_solutions(
        self,
        name: str,
        texts: list[str],
        found: list[dict[str, Any]],
        reranked: dict[str, Any] | None,
        context: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The first `search.solutions` of `found` (solution JSONs, best first) written to
        solutions/{name}.json, {name}-2.json, ...: {label: its record}, with the records of the re-ranking
        (`_rerank`) and of the scores in context (`_in_context`: the rounds of the candidate that went
        through them, the first before any re-ranking)."""
        settings = self.config.search
        saved: dict[str, Any] = {}
        for index, payload in enumerate(found[: settings.solutions]):
            label = name if index == 0 else f"{name}-{index + 1}"
            path = self.layout.solution(label)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, _solution_bytes(payload))
            saved[label] = {
                "budgets": texts,
                "file": str(path.relative_to(self.layout.root)),
                "fingerprint": fingerprint_file(path),
                "objective": payload["objective"],
            }
            _log.info("search %s: objective %.6g, %s", label, payload["objective"], payload["totals"])
        if reranked is not None:
            saved[name]["rerank"] = reranked
        if context is not None and saved:
            saved[name]["context"] = context
        wanted = max(settings.solutions, settings.rerank)
        if len(found) < wanted:
            _log.warning(
                "search %s: only %d architectures differ in >= %d blocks", name, len(found), settings.min_diff
            )
        return saved

    # -- measured re-ranking (search.rerank) --------------------------------------------------------------

    def _rerank_inputs(self, inputs: dict[str, Any]) -> None:
        """The search record's inputs with re-ranking: it reads the held-out tokens too. Off, the record's
        inputs are those of a run before the option existed (no `rerank` key), so old runs are reused."""
        rerank = inputs["search"].pop("rerank", 0)
        if rerank > 1:
            inputs["rerank"] = {
                "k": rerank,
                "held_out": self._held_out_key(),
                "vocab_chunk": self.config.scoring.vocab_chunk,
            }

    def _rerank(
        self, name: str, found: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """`found` (solution JSONs, best predicted first) re-ranked by the KL each child measures on the
        held-out tokens (`puzzle.problem.rerank_by_measurement`), one candidate child in memory at a time;
        as it is, and None, with `search.rerank` <= 1. Every rank calls it (the measurement is a collective)."""
        if self.config.search.rerank <= 1:
            return found, None

        def measure(payload: dict[str, Any]) -> dict[str, Any]:
            child = self._child_of(payload)
            return measured_kl(child, self.parent(), self.held_out_batches(), self.config.scoring.vocab_chunk)

        return rerank_by_measurement(name, found, measure)

    # -- scores in context (search.context_rounds; puzzle.context) ---------------------------------------

    def _in_context(
        self,
        name: str,
        budgets: Sequence[str | DeploymentLimit],
        problem: RunProblem,
        found: list[Solution],
    ) -> tuple[list[Solution], dict[str, Any] | None]:
        """(the solutions, the rounds' record) after `search.context_rounds` rounds of scores in context on
        the best one (`puzzle.context.context_rounds`); (found, None) when off. Collective: every rank
        scores (solutions/context/{name}/round-{r}/), rank 0 solves."""
        settings = self.config.search
        if not settings.context_rounds or not found:
            return found, None
        parent = self.parent(self.config.scoring.shard)
        library = read_library(self.layout.library)

        def score_in_child(number: int, own: list[Variant], wanted: list[Variant], what: str) -> Scores:
            return self._context_scores(name, number, parent, library, own, wanted, what)

        def solve(candidates: RunCandidates, own: list[Variant]) -> Solution:
            round_problem = self._problem(budgets, candidates=candidates)
            if settings.context_changes:
                limit_changes(round_problem, own, settings.context_changes)
            return _search_on_main(round_problem, settings.solver)

        return context_rounds(name, found, problem.candidates, settings, score_in_child, solve)

    def _context_scores(
        self,
        name: str,
        number: int | str,
        parent: HybridLM,
        library: Library,
        own: list[Variant],
        wanted: list[Variant],
        what: str = "round",
    ) -> Scores:
        """`wanted` scored in the child whose blocks are `own` (assembled from the library; a collective),
        into solutions/context/{name}/{what}-{number}/."""
        choice = {variant.block_index: variant for variant in own}
        child = assemble_child(choice, library, parent, parent_fp=self.parent_fingerprint())
        context_fp = fingerprint_json(
            {"library": self.record("library")["manifest"], "choice": [v.to_dict() for v in own]}
        )
        out = self.layout.solutions / "context" / name / f"{what}-{number}"
        return self._score(parent, library, wanted, out, context=child, context_fp=context_fp)

    def scores_in_context(self, name: str, own: list[Variant], wanted: list[Variant]) -> Scores:
        """`wanted` scored in the child whose blocks are `own` (a collective; cached, like the rounds, under
        solutions/context/{name}/predict-{the child's fingerprint}/, one folder per child): what
        `puzzle.context.predict_in_context` ranks other architectures from, around a child the search chose."""
        parent = self.parent(self.config.scoring.shard)
        library = read_library(self.layout.library)
        child = fingerprint_json([v.to_dict() for v in own])[:12]
        return self._context_scores(name, child, parent, library, own, wanted, "predict")

    def _solution_json(self, name: str) -> dict[str, Any]:
        return json.loads(self.layout.solution(name).read_text())

    def solution_name(self, solution: Solution) -> str:
        """The name under which this run's search saved `solution` (solutions/{name}.json); RunError for a
        Solution that no search of this run returned (it is known by the fingerprint of its JSON)."""
        # `fingerprint_file` of the file it would have been saved to.
        fingerprint = hashlib.sha256(_solution_bytes(solution.to_json())).hexdigest()
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

    # -- assemble, distill, export ----------------------------------------------------------------------

    def _child(self, name: str, sharded: bool | None = None) -> HybridLM:
        """The assembled child of solution `name` (the parent, the library, the scores; a collective when
        the parent is sharded), sharded as the parent is unless `sharded` says otherwise."""
        return self._child_of(self._solution_json(name), sharded)

    def _child_of(self, data: Mapping[str, Any], sharded: bool | None = None) -> HybridLM:
        """The assembled child of a solution's JSON `data` (as `_child`)."""
        choice = {int(block.rsplit("_", 1)[1]): variant for block, variant in data["choices"].items()}
        return assemble_child(
            choice,
            read_library(self.layout.library),
            self.parent(),
            scores=load_scores(self.layout.scores),
            parent_fp=self.parent_fingerprint(),
            shard_child=sharded,
        )

    def _solution_fp(self, name: str) -> str:
        return fingerprint_file(self.layout.solution(name))

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
        self._assembled(name)
        child = self._child(name)
        self._models[child] = (name, "assemble")
        return child

    def measured(self, model: HybridLM) -> dict[str, Any]:
        """The recorded KL to the parent of the child that `model` was assembled from: `kl` (measured on
        held-out tokens) and `predicted_kl` (the search's objective), as `measured_kl` reports them."""
        name, _ = self._source(model)
        return dict(self._assembled(name)["measured"])

    def _assembled(self, name: str) -> dict[str, Any]:
        def inputs() -> dict[str, Any]:
            return {"solution": self._solution_fp(name), **self._assemble_inputs()}

        return self._per_solution("assemble", name, inputs, lambda: self._measure(name))

    def _assemble_inputs(self) -> dict[str, Any]:
        return {
            "library": self.record("library")["manifest"],
            "held_out": self._held_out_key(),
            "vocab_chunk": self.config.scoring.vocab_chunk,
        }

    def _measure(self, name: str) -> dict[str, Any]:
        child = self._child(name)
        parent = self.parent()
        measured = measured_kl(child, parent, self.held_out_batches(), self.config.scoring.vocab_chunk)
        _log.info(
            "assemble %s: measured KL %.6g, predicted %s", name, measured["kl"], measured["predicted_kl"]
        )
        return {"measured": measured, "spec": fingerprint_json(child.spec.to_dict())}

    def _record_assemble(self) -> dict[str, Any]:
        upstream = self.record("solutions")
        inputs = {"solutions": {name: entry["fingerprint"] for name, entry in upstream.items()}}
        inputs.update(self._assemble_inputs())

        return self._stage("assemble", inputs, lambda: {name: self._measure(name) for name in upstream})

    def distill(self, child: HybridLM) -> HybridLM:
        """GKD of `child` (from `run.assemble`) against the parent (children/{name}/; resumes from its
        checkpoints): the distilled child, the checkpoint with the best held-out evaluation."""
        name, source = self._source(child)
        if source != "assemble":
            raise RunError(
                f"this model is the distilled child of {name!r} already; distill its assembled child"
            )

        self._distilled(name)
        distilled = load_distilled(self.layout.child(name), self._child(name))
        self._models[distilled] = (name, "distill")
        return distilled

    def _distilled(self, name: str) -> dict[str, Any]:
        def inputs() -> dict[str, Any]:
            return {
                "assemble": fingerprint_json({name: self._assembled(name)}),
                "solutions": {name: self._solution_fp(name)},
                **self._distill_inputs(),
            }

        return self._per_solution("distill", name, inputs, lambda: self._distill_one(name))

    def _distill_inputs(self) -> dict[str, Any]:
        return {
            "data": self.data.train.fingerprint(),
            "held_out": self._held_out_key(),
            "gkd": to_dict(self.config.gkd),
            "world": dist.world_size(),
        }

    def _distill_one(self, name: str) -> dict[str, Any]:
        teacher = self.parent(self.config.gkd.shard)  # first: the child is then sharded as the teacher is
        result = distill_child(
            self._child(name),
            teacher,
            self.data.train,
            self.held_out_batches(),
            self.config.gkd,
            self.layout.child(name),
            teacher_fp=self.parent_fingerprint(),
        )
        if result.resumed_from is not None:
            self._resumed.setdefault("distill", []).append(f"{name} from step {result.resumed_from}")
        _log.info(
            "distill %s: KL %.6g -> %.6g (kept step %d of %d)",
            name,
            result.first_eval.get("kl", math.nan),
            result.kept_eval.get("kl", math.nan),
            result.kept_step,
            result.steps,
        )
        return {
            "steps": result.steps,
            "tokens": result.tokens,
            "first_eval": result.first_eval,
            "last_eval": result.last_eval,
            "kept_step": result.kept_step,  # the weights distilled: the best held-out KL's step
            "kept_eval": result.kept_eval,
            "manifest": self._manifest_fp(self.layout.child(name), "gkd"),
        }

    def _record_distill(self) -> dict[str, Any]:
        upstream = self.record("assemble")
        inputs = {
            "assemble": fingerprint_json(upstream),
            "solutions": {n: e["fingerprint"] for n, e in self.record("solutions").items()},
            **self._distill_inputs(),
        }
        return self._stage("distill", inputs, lambda: {name: self._distill_one(name) for name in upstream})

    def export(self, child: HybridLM, path: str | Path | None = None) -> Path:
        """`child` (from `run.distill`, or `run.assemble` to export it undistilled) as a checkpoint at `path`
        (default: exports/{name}/) with its model card (rank 0); returns the checkpoint's directory."""
        name, source = self._source(child)
        out = self.layout.export(name) if path is None else Path(path).absolute()
        if source == "distill" and out == self.layout.export(name) and name in self.record("solutions"):
            entry = self.record("export")[name]
        else:
            if source == "distill":
                made_from = {"distill": self._distilled(name)["manifest"]}
            else:
                made_from = {"assemble": fingerprint_json(self._assembled(name))}
            inputs = {**made_from, "solution": self._solution_fp(name), "path": str(out)}
            entry = self._stage(f"export/{name}", inputs, lambda: self._export_one(name, source, out))[name]
        return self.layout.root / entry["path"]

    def _export_one(self, name: str, source: str, out: Path) -> dict[str, Any]:
        """{name: its export record}: the child built on every rank, sharded as the parent is (assembling from
        a sharded parent is a collective). A sharded child is written by every rank together: the weights
        stream out one tensor at a time, gathered on every rank and written by rank 0
        (`puzzle.nemotron_h.stream`), so no rank holds the whole child; a whole one by rank 0 alone."""
        child = self._child(name)
        if source == "distill":
            child = load_distilled(self.layout.child(name), child)  # into each rank's shards
        if shard.local_numel(child) < sum(p.numel() for p in child.parameters()):  # sharded: a collective
            return {name: self._write_export(name, source, child, out)}
        return _on_main(lambda: {name: self._write_export(name, source, child, out)})  # whole: rank 0 writes

    def _card_info(self, name: str, source: str) -> dict[str, Any]:
        """What the model card (`puzzle.card`) says of this run's solution `name` exported from its `source` ("assemble" or "distill"):
        budgets, solution file, GKD evaluations when distilled, the run config's fingerprint. Read from the
        manifest only: never runs a stage."""
        info: dict[str, Any] = {
            "solution": name,
            "source": source,
            "solution_file": str(self.layout.solution(name).relative_to(self.layout.root)),
            "config_fingerprint": fingerprint_json(self.config.to_dict()),
            "budgets": None,
            "distill": None,
        }
        for record_name, record in self.manifest()["stages"].items():
            stage = record_name.split("/", 1)[0]
            if record.get("status") not in ("done", "reused") or name not in record.get("outputs", {}):
                continue
            if stage == "solutions":
                info["budgets"] = list(record["outputs"][name].get("budgets", []))
            elif stage == "distill" and source == "distill":
                info["distill"] = dict(record["outputs"][name])
        return info

    def _write_export(self, name: str, source: str, child: HybridLM, out: Path) -> dict[str, Any]:
        written = export_checkpoint(
            child,
            out,
            parent_dir=self.config.parent.path,
            solution=self._solution_json(name),  # as saved: the search's table is not rebuilt to read it
            measured=self._assembled(name)["measured"],
            overwrite=True,
            run_info=self._card_info(name, source),
        )
        root = self.layout.root
        entry: dict[str, Any] = {
            "path": str(written.relative_to(root)) if written.is_relative_to(root) else str(written)
        }
        if dist.is_main():  # rank 0 wrote the files; its record is the one kept (`_stage` broadcasts it)
            # Each file's digest and stat key, hashed as written: the reuse check is then a stat per file.
            entry["files"] = {
                str(path.relative_to(written)): file_digest(path)
                for path in sorted(written.rglob("*"))
                if path.is_file()
            }
        return entry

    def _intact_export(
        self, before: Mapping[str, Any] | None, name: str, made_from: str
    ) -> dict[str, Any] | None:
        """The finished export record `before`'s entry of child `name` when it was exported from the same
        distilled child (`made_from`: its GKD manifest's fingerprint) and its files are as written: the
        export stage then redoes only the other children's exports (e.g. a damaged one)."""
        if before is None or before.get("status") not in DONE or name not in before.get("outputs", {}):
            return None
        entry = before["outputs"][name]
        if before.get("inputs", {}).get("distill", {}).get(name) != made_from or "files" not in entry:
            return None
        reason = dist.broadcast_object(self.ledger.export_damage(entry) if dist.is_main() else None)
        return entry if reason is None else None

    def _record_export(self) -> dict[str, Any]:
        upstream = self.record("distill")
        inputs = {"distill": {name: entry["manifest"] for name, entry in upstream.items()}}
        before = dist.broadcast_object(self.manifest()["stages"].get("export"))

        def compute() -> dict[str, Any]:
            outputs: dict[str, Any] = {}
            for name in upstream:  # one child at a time
                kept = self._intact_export(before, name, inputs["distill"][name])
                if kept is not None:
                    outputs[name] = kept
                    continue
                outputs.update(self._export_one(name, "distill", self.layout.export(name)))
            return outputs

        return self._stage("export", inputs, compute)

    # -- every stage ----------------------------------------------------------------------------------------

    def run(self, until: str | None = None) -> dict[str, Any]:
        """Every stage of this round in order (up to and including `until`); returns their recorded outputs."""
        if until is not None and until not in STAGES:
            raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
        for stage in STAGES:
            self.record(stage)
            if stage == until:
                break
        return {stage: self._results[stage] for stage in STAGES if stage in self._results}

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


# The recording layer of each stage (config-driven, as `puzzle run` records them), in `STAGES` order.
_RECORDERS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "importance": Run._record_importance,
    "library": Run._record_library,
    "scores": Run._record_scores,
    "solutions": Run._record_solutions,
    "assemble": Run._record_assemble,
    "distill": Run._record_distill,
    "export": Run._record_export,
}
assert tuple(_RECORDERS) == STAGES
