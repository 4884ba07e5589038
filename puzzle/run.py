"""The pipeline: one run config, one resumable run directory, one method per stage (`puzzle run`, notebooks).

    run = Run.from_config("run.yaml")          # or Run(run_dir, config)
    run.importance(); run.library(); run.scores(); run.solutions()
    run.assemble(); run.distill(); run.export()  # or run.all()

Stages, in order (`STAGES`): importance (activation importance of the parent, `puzzle.prune`), library
(BLD, `puzzle.bld`), scores (replace-one-block, `puzzle.score`), solutions (the search, one per budget list
/ sweep point and `search.solutions`, saved to solutions/{name}.json as `puzzle search --json` prints it),
assemble (the child of each solution and its measured KL to the parent, `puzzle.assemble`), distill (GKD,
`puzzle.gkd`, into children/{name}/) and export (exports/{name}/, `puzzle.export`).

The manifest (run.json, written atomically by rank 0) records the parent's fingerprint and, per stage, its
status (`running`, `failed`, `done` when computed by this invocation, `reused` when a finished output of the
same inputs was found), a content hash of its inputs (its config sections and the fingerprints of the
upstream outputs it reads) and its outputs with their fingerprints. A stage whose input hash matches a
finished record is not run again; any change reaches exactly the stages downstream of it through those
fingerprints (a new budget re-solves; the library and scores, which do not read the budget, are reused).
A killed stage resumes from its last completed unit: BLD's finished waves and checkpoints, scoring's
saved variants and GKD's checkpoints live in their directories and are reused by the stages themselves.

Distributed (torchrun): importance, BLD, scoring, measured KL and GKD run on every rank and shard their
work; the search and the export run on rank 0 while the others wait at a barrier. Round r >= 2 of an
iterative run (`rounds.count`) is a `Run` of its own in `round-{r}/`, whose parent is the previous round's
exported distilled child (`Run.all` chains them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from puzzle import dist
from puzzle.artifacts import fingerprint_file, fingerprint_json, fingerprint_model
from puzzle.config import RunConfig, dump_config, load_config, load_config_data, to_dict
from puzzle.files import atomic_write_bytes
from puzzle.layout import STAGES, RunDirError, RunLayout
from puzzle.model import HybridLM
from puzzle.spec import BlockSpec, ModelSpec, Variant

if TYPE_CHECKING:
    from puzzle.search.run_dir import CostModel

MANIFEST_FORMAT = 1
DONE = ("done", "reused")

_log = logging.getLogger(__name__)


class RunError(ValueError):
    """A run directory that cannot be used for this run (another parent, a malformed manifest)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _slug(budgets: list[str]) -> str:
    """A file name for a budget list: `active_params<=0.75x` -> `active_params-le-0.75x`."""
    text = "+".join(budgets).replace("<=", "-le-").replace(">=", "-ge-")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "solution"


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


class _SavedSolution:
    """A solution as saved in solutions/{name}.json, for `puzzle.export` (which reads `to_json`)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def to_json(self) -> dict[str, Any]:
        return dict(self.data)


class Run:
    """One round of a Puzzle run in `run_dir` from `config` (see the module docstring).

    `round_number`: 1 for the run itself; r >= 2 for round r (its run_dir is `round-{r}/` and the config's
    parent the previous round's child: `Run.all` makes those). Nothing is read or written until a stage
    method is called.
    """

    def __init__(self, run_dir: str | Path, config: RunConfig, *, round_number: int = 1) -> None:
        self.layout = RunLayout(Path(run_dir).absolute())
        self.config = config
        self.round_number = round_number
        self._parent_fp: str | None = None
        self._data: Any = None
        self._results: dict[str, Any] = {}
        # Stage -> what it resumed from checkpoints (BLD waves, GKD children), for its `done` line.
        self._resumed: dict[str, list[str]] = {}
        self._prepared = False
        self._budgets_checked = False

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
        from puzzle.search import search
        from puzzle.search.run_dir import RunCandidates, run_problem

        space = self.config.search_space()
        if any(kind.profiles for kind in space.kinds.values()) or any(
            o.space is not None and o.space.profiles for o in space.overrides
        ):
            return
        variants: list[list[BlockSpec]] = [[block] for block in parent.blocks]
        for index, listed in space.all_variants(parent).items():
            variants[index] += [v.spec for v in listed if v.spec != parent.blocks[index]]
        candidates = RunCandidates(parent, variants, [[0.0] * len(v) for v in variants])
        for texts in self.budgets().values():
            problem = run_problem(
                self.layout,
                texts,
                cost_model=self.cost_model(store=False),
                keep_blocks=self.config.search.keep_blocks,
                same_attributes=self.config.search.same_attributes,
                shared_state_size=self.config.search.shared_state_size,
                candidates=candidates,
            )
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
        path = self.layout.manifest
        if not path.is_file():
            return {"format": MANIFEST_FORMAT, "stages": {}}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise RunError(f"{path} is not a run manifest: {error}") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or "stages" not in data:
            raise RunError(f"{path} is not a run manifest of format {MANIFEST_FORMAT}")
        return data

    def _write_manifest(self, data: dict[str, Any]) -> None:
        if dist.is_main():
            atomic_write_bytes(self.layout.manifest, (json.dumps(data, indent=2) + "\n").encode())

    def _update(self, stage: str, record: dict[str, Any]) -> None:
        data = self.manifest()
        data["stages"][stage] = record
        self._write_manifest(data)

    # -- setup ------------------------------------------------------------------------------------------

    def parent_fingerprint(self) -> str:
        """The parent's fingerprint (`puzzle.artifacts.fingerprint_model` of its weights). The manifest's,
        when the parent's files are those it was computed from (`_parent_files`): a finished run reruns
        without loading the parent (minutes for a 120B one)."""
        if self._parent_fp is None:
            recorded = self.manifest().get("parent", {})
            if recorded.get("fingerprint") and recorded.get("files") == self._parent_files():
                self._parent_fp = str(recorded["fingerprint"])
            else:
                self._parent_fp = fingerprint_model(self.load_parent())
        return self._parent_fp

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
            data["parent"] = {
                "path": str(parent_dir),
                "fingerprint": fingerprint,
                "files": self._parent_files(),
            }
            data["round"] = self.round_number
            self._write_manifest(data)
        dist.barrier()
        self._prepared = True

    def load_parent(self) -> HybridLM:
        """A fresh copy of the parent, as the stages load it (BLD and GKD may shard the model they are given;
        the library's parent fingerprint matches it)."""
        from puzzle import nemotron_h

        dtype = None if self.config.parent.dtype == "auto" else self.config.parent.dtype
        model = nemotron_h.load(self.config.parent.path, dtype=dtype, device=dist.device())
        return model.eval().requires_grad_(False)

    @property
    def data(self) -> Any:
        """The run's TokenData (tokenised once, cached in data.cache_dir or RUN_DIR/tokens)."""
        if self._data is None:
            from puzzle.data import TokenData, tokenizer_files

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

    # -- the stage runner ---------------------------------------------------------------------------------

    def _stage(
        self, name: str, inputs: dict[str, Any], compute: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """Run stage `name` unless a finished record of the same inputs exists; returns its outputs."""
        self._prepare()
        key = fingerprint_json(inputs)
        record = dist.broadcast_object(self.manifest()["stages"].get(name))
        if (
            record is not None
            and record.get("status") in DONE
            and record.get("inputs_hash") == key
            and dist.broadcast_object(self._present(name, record["outputs"]))
        ):
            _log.info("%s%s: reused (inputs unchanged)", self._round_label(), name)
            self._update(name, {**record, "status": "reused", "checked": _now()})
            dist.barrier()
            self._results[name] = record["outputs"]
            return record["outputs"]
        _log.info("%s%s: running", self._round_label(), name)
        started = _now()
        running = {"status": "running", "inputs_hash": key, "inputs": inputs, "started": started}
        self._update(name, running)
        try:
            outputs = compute()
        except BaseException as error:
            self._update(name, {**running, "status": "failed", "error": f"{type(error).__name__}: {error}"})
            raise
        outputs = dist.broadcast_object(outputs)
        self._update(name, {**running, "status": "done", "finished": _now(), "outputs": outputs})
        dist.barrier()
        resumed = self._resumed.pop(name, [])
        note = f" (resumed from a checkpoint: {', '.join(resumed)})" if resumed else ""
        _log.info("%s%s: done%s", self._round_label(), name, note)
        self._results[name] = outputs
        return outputs

    def _round_label(self) -> str:
        return f"round {self.round_number}: " if self.config.rounds.count > 1 else ""

    def _present(self, name: str, outputs: dict[str, Any]) -> bool:
        """Whether the recorded outputs of stage `name` are still on disk, unchanged."""
        directories = {
            "importance": self.layout.importance,
            "library": self.layout.library,
            "scores": self.layout.scores,
        }
        if name in directories:
            path = directories[name] / f"{name}.manifest.json"
            return path.is_file() and fingerprint_file(path) == outputs["manifest"]
        for entry_name, entry in outputs.items():
            if name == "solutions":
                path = self.layout.root / entry["file"]
                if not path.is_file() or fingerprint_file(path) != entry["fingerprint"]:
                    return False
            elif name == "distill":
                path = self.layout.child(entry_name) / "gkd.manifest.json"
                if not path.is_file() or fingerprint_file(path) != entry["manifest"]:
                    return False
            elif name == "export" and not (self.layout.root / entry["path"] / "config.json").is_file():
                return False
        return True

    def _outputs(self, name: str) -> dict[str, Any]:
        """The outputs of stage `name`, running it (and what it needs) first if this Run has not."""
        if name not in self._results:
            getattr(self, name)()
        return self._results[name]

    # -- the stages -----------------------------------------------------------------------------------

    def importance(self) -> dict[str, Any]:
        """Activation importance of the parent on importance.tokens training tokens -> importance/."""
        self._check_budgets_up_front()
        settings = self.config.importance
        inputs = {
            "parent": self.parent_fingerprint(),
            "data": self.data.train.fingerprint(),
            "settings": to_dict(settings),
            "seed": self.config.seed,
        }

        def compute() -> dict[str, Any]:
            from puzzle.prune.importance import importance_for

            importance_for(
                self.load_parent(),
                self._calibration,
                self.layout.importance,
                linear_fit=settings.linear_fit,
                linear_fit_every=settings.linear_fit_every,
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
        return fingerprint_file(directory / f"{stage}.manifest.json")

    def _variants(self, parent: HybridLM) -> dict[int, list[Variant]]:
        from puzzle.prune.importance import load_importance

        return self.config.search_space().all_variants(parent.spec, load_importance(self.layout.importance))

    def library(self) -> dict[str, Any]:
        """BLD of every variant of the space -> library/ (resumes from its checkpoints)."""
        self._check_budgets_up_front()
        upstream = self._outputs("importance")
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
            from puzzle.bld import build_library
            from puzzle.prune.importance import load_importance

            parent = self.load_parent()
            split, batch = self.data.train, self.config.data.batch_size
            library = build_library(
                parent,
                self._variants(parent),
                lambda: split.batches(batch, self.config.seed, rank=0, world=1),
                self.held_out_batches(),
                load_importance(self.layout.importance),
                self.config.bld,
                self.layout.library,
                data_fingerprint=fingerprint_json([split.fingerprint(), batch, self.config.seed]),
            )
            self._resumed["library"] = [
                f"wave {number + 1} from step {step}" for number, step in library.resumed.items()
            ]
            return {"manifest": self._manifest_fp(self.layout.library, "library")}

        return self._stage("library", inputs, compute)

    def scores(self) -> dict[str, Any]:
        """Replace-one-block scores of every usable library variant on held-out tokens -> scores/."""
        self._check_budgets_up_front()
        upstream = self._outputs("library")
        inputs = {
            "library": upstream["manifest"],
            "held_out": self._held_out_key(),
            "scoring": to_dict(self.config.scoring),
        }

        def compute() -> dict[str, Any]:
            from puzzle.blocks import build_block
            from puzzle.library import read_library
            from puzzle.score import score_variants

            parent = self.load_parent()
            library = read_library(self.layout.library)
            usable = [v for v, r in library.results.items() if r.status != "failed"]
            hidden, eps = parent.spec.hidden_size, parent.spec.norm_eps

            def mixer(variant: Variant) -> torch.nn.Module | None:
                status = library.results[variant].status
                if status == "parent":
                    return None
                if status == "noop":
                    return build_block(variant.spec, hidden).to(dist.device())
                module = library.load_mixer(variant, hidden, eps)
                return module.to(device=dist.device(), dtype=parent.embeddings.weight.dtype)

            fingerprints = {
                v: fingerprint_json([r.status, r.file, self._file_fp(library, r)])
                for v, r in library.results.items()
                if r.status != "failed"
            }
            score_variants(
                parent,
                usable,
                mixer,
                self.held_out_batches(),
                self.layout.scores,
                self.config.scoring,
                data_fingerprint=self._held_out_key(),
                mixer_fingerprints=fingerprints,
            )
            return {"manifest": self._manifest_fp(self.layout.scores, "scores")}

        return self._stage("scores", inputs, compute)

    @staticmethod
    def _file_fp(library: Any, result: Any) -> str | None:
        if result.file is None:
            return None
        return fingerprint_file(Path(library.directory) / result.file)

    def budgets(self) -> dict[str, list[str]]:
        """{solution name: budget texts} of this round (one per budget list / sweep point)."""
        lists = self.config.round_budgets(self.round_number - 1)
        names: dict[str, list[str]] = {}
        for texts in lists:
            name = _slug(texts)
            while name in names:
                name += "_"
            names[name] = texts
        return names

    def cost_model(self, *, store: bool = True) -> CostModel:
        """The search's cost model of this run, from its `hardware` settings. "this-machine" is the run's
        calibration (`RunLayout.hardware`: RUN_DIR/hardware.json, measured and stored on first use), so
        the search, `puzzle search RUN_DIR`, `puzzle report` and the demo price with the same figures.
        `store=False` (`check_budgets`, before the run directory is checked) uses a stored calibration
        but measures without storing one."""
        from puzzle.search.run_dir import CostModel

        kwargs = self.config.hardware.cost_model_kwargs()
        if store or self.layout.calibration.is_file():
            kwargs["hardware"] = self.layout.hardware(kwargs["hardware"])
        return CostModel(**kwargs)

    def solutions(self) -> dict[str, Any]:
        """The search under each budget list (rank 0) -> solutions/{name}.json; `search.solutions` > 1 adds
        `{name}-2`, ... InfeasibleError when a budget cannot be met."""
        upstream = self._outputs("scores")
        library = self._outputs("library")
        search = self.config.search
        inputs = {
            "library": library["manifest"],
            "scores": upstream["manifest"],
            "budgets": self.budgets(),
            "search": to_dict(dataclasses.replace(search, budgets=(), sweep=None)),
            "hardware": to_dict(self.config.hardware),
        }
        self._prepare()  # the calibration is stored in the checked run directory
        if dist.is_main():
            self.cost_model()  # rank 0 measures and stores this machine's calibration once, if absent
        dist.barrier()
        device = self.cost_model().hardware
        if not isinstance(device, str):  # this machine's calibration: new figures re-solve
            from puzzle.cost.hardware import profile_to_json

            inputs["calibration"] = profile_to_json(device)

        return self._stage("solutions", inputs, lambda: _on_main(self._solve))

    def _solve(self) -> dict[str, Any]:
        from puzzle.search import search_k
        from puzzle.search.run_dir import run_problem

        search = self.config.search
        saved: dict[str, Any] = {}
        for name, texts in self.budgets().items():
            problem = run_problem(
                self.layout,
                texts,
                objective=search.objective,
                cost_model=self.cost_model(),
                keep_blocks=search.keep_blocks,
                same_attributes=search.same_attributes,
                shared_state_size=search.shared_state_size,
            )
            for note in problem.notes:
                _log.warning("search %s: %s", name, note)
            found = search_k(
                problem.table,
                problem.problem.limits,
                problem.problem.rules,
                search.solver,
                search.solutions,
                search.min_diff,
            )
            for index, solution in enumerate(found):
                label = name if index == 0 else f"{name}-{index + 1}"
                payload = solution.to_json()
                path = self.layout.solution(label)
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, (json.dumps(payload, indent=2) + "\n").encode())
                saved[label] = {
                    "budgets": texts,
                    "file": str(path.relative_to(self.layout.root)),
                    "fingerprint": fingerprint_file(path),
                    "objective": solution.objective,
                }
                _log.info("search %s: objective %.6g, %s", label, solution.objective, payload["totals"])
            if len(found) < search.solutions:
                _log.warning(
                    "search %s: only %d architectures differ in >= %d blocks",
                    name,
                    len(found),
                    search.min_diff,
                )
        return saved

    def _child(self, name: str) -> HybridLM:
        """The assembled child of solution `name` (a fresh parent, the library, the scores)."""
        from puzzle.assemble import assemble
        from puzzle.library import read_library
        from puzzle.score import load_scores

        data = json.loads(self.layout.solution(name).read_text())
        choice = {int(block.rsplit("_", 1)[1]): variant for block, variant in data["choices"].items()}
        return assemble(
            choice,
            read_library(self.layout.library),
            self.load_parent(),
            scores=load_scores(self.layout.scores),
        )

    def assemble(self) -> dict[str, Any]:
        """Each solution's child and its measured KL to the parent on held-out tokens (every rank)."""
        upstream = self._outputs("solutions")
        inputs = {
            "solutions": {name: entry["fingerprint"] for name, entry in upstream.items()},
            "library": self._outputs("library")["manifest"],
            "held_out": self._held_out_key(),
            "vocab_chunk": self.config.scoring.vocab_chunk,
        }

        def compute() -> dict[str, Any]:
            from puzzle.assemble import measured_kl

            parent, held_out = self.load_parent(), self.held_out_batches()
            outputs = {}
            for name in upstream:
                child = self._child(name)
                measured = measured_kl(child, parent, held_out, self.config.scoring.vocab_chunk)
                outputs[name] = {"measured": measured, "spec": fingerprint_json(child.spec.to_dict())}
                _log.info(
                    "assemble %s: measured KL %.6g, predicted %s",
                    name,
                    measured["kl"],
                    measured["predicted_kl"],
                )
            return outputs

        return self._stage("assemble", inputs, compute)

    def distill(self) -> dict[str, Any]:
        """GKD of each child against the parent -> children/{name}/ (resumes from its checkpoints)."""
        upstream = self._outputs("assemble")
        inputs = {
            "assemble": fingerprint_json(upstream),
            "solutions": {n: e["fingerprint"] for n, e in self._outputs("solutions").items()},
            "data": self.data.train.fingerprint(),
            "held_out": self._held_out_key(),
            "gkd": to_dict(self.config.gkd),
            "world": dist.world_size(),
        }

        def compute() -> dict[str, Any]:
            from puzzle.gkd import distill

            outputs = {}
            for name in upstream:
                result = distill(
                    self._child(name),
                    self.load_parent(),
                    self.data.train,
                    self.held_out_batches(),
                    self.config.gkd,
                    self.layout.child(name),
                )
                if result.resumed_from is not None:
                    self._resumed.setdefault("distill", []).append(f"{name} from step {result.resumed_from}")
                outputs[name] = {
                    "steps": result.steps,
                    "tokens": result.tokens,
                    "first_eval": result.first_eval,
                    "last_eval": result.last_eval,
                    "manifest": self._manifest_fp(self.layout.child(name), "gkd"),
                }
                _log.info(
                    "distill %s: KL %.6g -> %.6g",
                    name,
                    result.first_eval.get("kl", math.nan),
                    result.last_eval.get("kl", math.nan),
                )
            return outputs

        return self._stage("distill", inputs, compute)

    def export(self) -> dict[str, Any]:
        """Each distilled child as a checkpoint -> exports/{name}/ (rank 0)."""
        upstream = self._outputs("distill")
        assembled = self._outputs("assemble")
        inputs = {"distill": {name: entry["manifest"] for name, entry in upstream.items()}}

        def compute() -> dict[str, Any]:
            from puzzle.export import export
            from puzzle.gkd import load_distilled

            outputs: dict[str, Any] = {}
            for name in upstream:
                child = load_distilled(self.layout.child(name), self._child(name))
                solution = _SavedSolution(json.loads(self.layout.solution(name).read_text()))
                path = export(
                    child,
                    self.layout.export(name),
                    parent_dir=self.config.parent.path,
                    solution=solution,
                    measured=assembled[name]["measured"],
                    overwrite=True,
                )
                outputs[name] = {"path": str(path.relative_to(self.layout.root))}
            return outputs

        return self._stage("export", inputs, lambda: _on_main(compute))

    def run(self, until: str | None = None) -> dict[str, Any]:
        """Every stage of this round in order (up to and including `until`); returns their outputs."""
        if until is not None and until not in STAGES:
            raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
        for stage in STAGES:
            getattr(self, stage)()
            if stage == until:
                break
        return dict(self._results)

    def all(self, until: str | None = None) -> list[Run]:
        """Every stage of every round (`rounds.count`); returns the rounds' Runs. Round r >= 2's parent is
        round r - 1's exported child of its `rounds.pick`-th solution (1 = the first)."""
        rounds = [self]
        self.run(until)
        current = self
        for number in range(2, self.config.rounds.count + 1):
            if until is not None and until != "export":
                break
            exports = current._outputs("export")
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
            current = Run(self.layout.round(number).root, config, round_number=number)
            current.run()
            rounds.append(current)
        return rounds
