"""What every stage of a run shares: its config and directory, the ledger (run.json), the parent
(fingerprinted from its files, loaded once per process), the data and held-out batches, the search
problem of its budgets, and the child of a saved solution.

`RunContext` is what a stage module (`puzzle.run.importance`, ... `puzzle.run.export`) is given;
`record(stage)` runs a stage through its module's `record` (the table `RECORDERS` of
`puzzle.run.api.Run`) unless this run has, and `stage(name, inputs, compute)` applies the ledger's reuse
rule once the run directory is prepared.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from puzzle import dist, hostmem, nemotron_h, shard
from puzzle.artifacts import (
    checkpoint_hashes,
    fingerprint_file,
    fingerprint_json,
    fingerprint_model,
    loaded_fingerprint,
    manifest_fingerprint,
    read_hash_cache,
    write_hash_cache,
)
from puzzle.assemble import assemble as assemble_child
from puzzle.config import RunConfig, dump_config, load_config_data
from puzzle.cost.serving import CostModel
from puzzle.data import TokenData, tokenizer_files
from puzzle.files import atomic_write_bytes
from puzzle.kv_cache import calibrated
from puzzle.layout import STAGES, RunDirError, RunLayout
from puzzle.ledger import Ledger, RunError, peak_rss_mib
from puzzle.library import read_library
from puzzle.model import HybridLM
from puzzle.problem import RunCandidates, RunProblem, run_problem
from puzzle.run.disk import check_stage_disk
from puzzle.scores import load_scores
from puzzle.search import search
from puzzle.spec import BlockSpec, ModelSpec, Variant

if TYPE_CHECKING:
    from puzzle.search.budget import DeploymentLimit

# run.json's parent record: how its fingerprint was made (`RunContext.parent_fingerprint`). Records without it
# (earlier versions) hold `fingerprint_model` of the loaded parent.
PARENT_SCHEME = "checkpoint-files-1"

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def manifest_fp(directory: Path, stage: str) -> str:
    """The content fingerprint of stage `stage`'s manifest in `directory` (what a record's inputs name)."""
    return manifest_fingerprint(directory / f"{stage}.manifest.json")


def slug(budgets: list[str]) -> str:
    """A file name for a budget list: `active_params<=0.75x` -> `active_params-le-0.75x`."""
    text = "+".join(budgets).replace("<=", "-le-").replace(">=", "-ge-")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "solution"


def _write_if_changed(path: Path, content: bytes) -> None:
    """Write `path` atomically unless it already holds `content` (a rerun leaves finished files alone)."""
    if not (path.is_file() and path.read_bytes() == content):
        atomic_write_bytes(path, content)


def on_main(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
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


class RunContext:
    """One round of a run in `run_dir` under a validated `config`: what its stages share (module docstring).
    `round_number`: 1 for the run itself, r >= 2 for round r of an iterative run."""

    # {stage: its module's `record(run)`}, in `STAGES` order; `puzzle.run.api.Run` names the stage modules.
    RECORDERS: ClassVar[Mapping[str, Callable[[RunContext], dict[str, Any]]]] = MappingProxyType({})
    # {record name's stage: its module's `damage(run, outputs)`}: how that stage's recorded outputs are
    # checked on disk before they are reused (`Ledger.run`); `Run` names them beside the recorders.
    OUTPUT_CHECKS: ClassVar[Mapping[str, Callable[[RunContext, dict[str, Any]], str | None]]] = (
        MappingProxyType({})
    )

    def __init__(self, run_dir: str | Path, config: RunConfig, round_number: int = 1) -> None:
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
        # How it is laid out: "none" (whole), "fsdp" or "hsdp" (sharded from the files).
        self._parent_mode = "none"
        self._data: Any = None
        self._results: dict[str, Any] = {}
        self._prepared = False
        self._budgets_checked = False
        # Stage -> what it resumed from checkpoints (BLD waves, GKD children), for its `done` line.
        self.resumed: dict[str, list[str]] = {}
        # (library manifest hash, {variant: its mixer's fingerprint}): `puzzle.run.scores`' cache.
        self.mixer_fps: tuple[str, dict[Variant, str]] | None = None

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
            problem = self.problem(limits, cost_model=self.cost_model(store=False), candidates=candidates)
            search(problem.table, problem.problem.limits, problem.problem.rules, self.config.search.solver)
        self._budgets_checked = True

    def check_budgets_up_front(self) -> None:
        """`check_budgets` on the parent's config.json, once per Run, before a stage reads data or writes
        anything: an unmeetable budget fails in seconds, not after importance, BLD and scoring (as `puzzle
        run` checks it). The training stages call it first; a Run that already checked (`puzzle run`, the
        demo) does not check again."""
        if not self._budgets_checked:
            self.check_budgets(self.config.validate_paths())

    def manifest(self) -> dict[str, Any]:
        """run.json as it is on disk (an empty manifest before the first stage)."""
        return self.ledger.manifest()

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

    def prepare(self) -> None:
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
                "parent loaded sharded (%s) over %d of the %d ranks: this rank holds %d of its %d parameter "
                "elements",
                mode,
                shard.ways(mode),  # hsdp: the ranks of a node, replicated across nodes
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

    def held_out_key(self) -> str:
        settings = self.config.data
        return fingerprint_json(
            {
                "split": self.data.held_out.fingerprint(),
                "batch": settings.eval_batch_size,
                "tokens": settings.held_out_tokens,
                "seed": self.config.seed,
            }
        )

    def stage(
        self, name: str, inputs: dict[str, Any], compute: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """Record `name` (a stage, or STAGE/SOLUTION) through the ledger's reuse rule (`Ledger.run`), once the
        run directory is prepared; its outputs, kept for `record`."""
        self.prepare()
        stage = name.split("/", 1)[0]

        def checked() -> dict[str, Any]:
            check_stage_disk(self.config, self.layout, stage)  # before any work, only when it runs
            return compute()

        outputs = self.ledger.run(
            name,
            inputs,
            checked,
            damage=lambda recorded: self.output_damage(name, recorded),
            resumed=lambda: self.resumed.pop(stage, []),
        )
        self._results[name] = outputs
        return outputs

    def output_damage(self, name: str, outputs: dict[str, Any]) -> str | None:
        """Why the recorded `outputs` of record `name` (a stage or STAGE/SOLUTION) are not as written on disk
        (the first damaged file), or None: the check its stage's module declares (`OUTPUT_CHECKS`)."""
        stage = name.split("/", 1)[0]
        if stage not in self.OUTPUT_CHECKS:
            raise ValueError(
                f"record {name!r}: no output check for stage {stage!r} ({', '.join(self.OUTPUT_CHECKS)})"
            )
        return self.OUTPUT_CHECKS[stage](self, outputs)

    def record(self, stage: str) -> dict[str, Any]:
        """The manifest layer: the recorded outputs of `stage` (one of `STAGES`) for what the run config asks,
        running it (and what it needs) first unless this Run has. Dicts of fingerprints and figures: a
        solution's file and objective, a child's measured KL, GKD's first and last evaluations, an export's
        path (relative to the run directory)."""
        if stage not in self._results:
            if stage not in self.RECORDERS:
                raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
            self.RECORDERS[stage](self)
        return self._results[stage]

    def per_solution(
        self, stage: str, name: str, inputs: Callable[[], dict[str, Any]], compute: Callable[[], Any]
    ) -> dict[str, Any]:
        """Stage `stage`'s record of solution `name`: the config's stage when `name` is one of its solutions
        (recorded together, as `puzzle run` does), else a record of its own, STAGE/NAME, of `inputs()`."""
        if name in self.record("solutions"):
            return self.record(stage)[name]
        return self.stage(f"{stage}/{name}", inputs(), lambda: {name: compute()})[name]

    def budgets(self) -> dict[str, list[str]]:
        """{solution name: budget texts} of this round (one per budget list / sweep point)."""
        return {name: [limit.text for limit in limits] for name, limits in self.budget_limits().items()}

    def budget_limits(self) -> dict[str, list[DeploymentLimit]]:
        """{solution name: budgets} of this round as the config read them (`RunConfig.round_limits`), the
        objects the search takes."""
        names: dict[str, list[DeploymentLimit]] = {}
        for limits in self.config.round_limits(self.round_number - 1):
            name = slug([limit.text for limit in limits])
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

    def problem(
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
            engines=search_settings.engines,
        )

    def solution_json(self, name: str) -> dict[str, Any]:
        return json.loads(self.layout.solution(name).read_text())

    def solution_fp(self, name: str) -> str:
        return fingerprint_file(self.layout.solution(name))

    def child(self, name: str, sharded: bool | None = None) -> HybridLM:
        """The assembled child of solution `name` (the parent, the library, the scores; a collective when
        the parent is sharded), sharded as the parent is unless `sharded` says otherwise."""
        return self.child_of(self.solution_json(name), sharded)

    def child_of(self, data: Mapping[str, Any], sharded: bool | None = None) -> HybridLM:
        """The assembled child of a solution's JSON `data` (as `_child`)."""
        choice = {int(block.rsplit("_", 1)[1]): variant for block, variant in data["choices"].items()}
        child = assemble_child(
            choice,
            read_library(self.layout.library),
            self.parent(),
            scores=load_scores(self.layout.scores),
            parent_fp=self.parent_fingerprint(),
            shard_child=sharded,
        )
        return self.with_kv_cache(child)

    def calibration_batches(self, tokens: int, batch_size: int) -> Iterator[torch.Tensor]:
        """About `tokens` calibration tokens from the train split, batches of `batch_size` sequences (the run's
        seed, the same on every rank), on this rank's device."""
        split = self.data.train
        count = max(1, math.ceil(tokens / (batch_size * split.seq_len)))
        stream = split.batches(batch_size, self.config.seed, rank=0, world=1)
        return (batch.to(dist.device()) for _, batch in zip(range(count), stream))

    def with_kv_cache(self, model: HybridLM) -> HybridLM:
        """`model` with the run's KV cache (`kv_cache`): for fp8, scales calibrated on its own keys and values
        over `kv_cache.tokens` calibration tokens (`puzzle.kv_cache.calibrated`); bf16: as it is."""
        settings = self.config.kv_cache
        if settings.dtype != "fp8":
            return model
        return calibrated(model, self.calibration_batches(settings.tokens, self.config.importance.batch_size))
