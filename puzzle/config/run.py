"""The run config: one YAML file describing a whole Puzzle run, loaded into `RunConfig` with strict validation.

`load_config(path)` reads and validates it (types, values, budgets against the scenarios, rounds);
`RunConfig.validate_paths()` checks what it names on disk (the parent's config.json and weights, the
tokenizer, the data, the space file) without loading a weight. Sections reuse the stages' own settings
where they exist (`puzzle.bld.BLDSettings`, `puzzle.gkd.GKDSettings`, `puzzle.score.ScoreSettings`, `puzzle.search.SolverOptions`,
`puzzle.cost.Scenario`, and the search's cost model `puzzle.cost.serving.CostModel` as the `hardware`
section). Budgets are texts in the syntax of `puzzle search RUN_DIR` over deployment keys (`BUDGET_KEYS`:
`active_params<=0.6x`, `throughput[chat]>=1.5x`), read here once by the search's own parser into
`DeploymentLimit`s, which the search takes as they are (`RunConfig.round_limits`; the texts:
`RunConfig.round_budgets`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from puzzle.config.loader import ConfigError, doc, error_key, from_data, line_of, read_yaml, to_dict
from puzzle.cost.limits import Bound, BudgetError, Value
from puzzle.cost.serving import CostModel
from puzzle.presets import SPACE_PRESETS, get_space_preset
from puzzle.search import budget
from puzzle.search.budget import DeploymentLimit
from puzzle.search.frontier import parse_sweep
from puzzle.search.types import SolverOptions
from puzzle.settings import BLDSettings, GKDSettings, ScoreSettings, check_shard_mode
from puzzle.space import SearchSpace
from puzzle.spec import ModelSpec

# The `hardware` section is the search's cost model itself (one type: profile, memory fraction, recipe,
# scenarios); the old name stays for code that imports it.
HardwareConfig = CostModel


def parse_budget(text: str, hardware: CostModel | None = None) -> DeploymentLimit:
    """A run budget (`active_params<=0.6x`, `throughput[chat,long]>=1.5x`) read by the search's own parser
    (`puzzle.search.budget.parse_budget`) against the cost model `hardware` (its scenarios). ConfigError
    (without a key path) if malformed."""
    try:
        return budget.parse_budget(text, hardware if hardware is not None else CostModel(), where="config")
    except BudgetError as error:
        raise ConfigError(str(error)) from None


def _sweep_budget(key: str, side: str, value: Value) -> str:
    return str(Bound(key, **{side: value}))


@dataclass(frozen=True)
class ParentConfig:
    """The model to compress: a NemotronH checkpoint directory in the Hugging Face layout."""

    path: Path = field(
        metadata=doc(
            "The parent checkpoint directory: config.json and safetensors weights. Never written to."
        )
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(
        default="auto",
        metadata=doc("The parent's compute dtype once loaded; auto keeps the checkpoint's own."),
    )


@dataclass(frozen=True)
class DataConfig:
    """Training and held-out tokens (read by `puzzle.data.TokenData.load`)."""

    sources: tuple[Path, ...] = field(
        metadata=doc(
            "Files or folders of data: text (.txt, .text, .md: documents separated by blank lines), JSONL "
            "(.jsonl), token files (.safetensors) or datasets saved with save_to_disk; a folder stands for the "
            "data files under it."
        )
    )
    seq_len: int = field(
        default=4096, metadata=doc("Tokens per training sequence (documents are packed end to end).")
    )
    text_field: str = field(
        default="text", metadata=doc("The text field of JSONL records and saved datasets.")
    )
    tensor_name: str = field(
        default="input_ids", metadata=doc("The tensor of token ids in .safetensors sources.")
    )
    dataset_split: str | None = field(
        default=None, metadata=doc("The split of a saved DatasetDict (null: 'train').")
    )
    held_out_fraction: float = field(
        default=0.05,
        metadata=doc(
            "Share of documents held out for scoring and evaluation, chosen by a seeded hash of each document."
        ),
    )
    test_fraction: float = field(
        default=0.0,
        metadata=doc(
            "Share of documents set aside as a test split, taken from the held-out ones by the same hash "
            "(below held_out_fraction; 0: none): no stage reads it (not scoring, search, GKD's evaluations "
            "or checkpoint choice), so numbers reported on it are free of every choice."
        ),
    )
    split_seed: int = field(
        default=0,
        metadata=doc("Seed of the held-out split (independent of `seed`, so the split stays put)."),
    )
    batch_size: int = field(
        default=8, metadata=doc("Sequences per global batch (all ranks together) for BLD training.")
    )
    eval_batch_size: int = field(
        default=8, metadata=doc("Sequences per batch for scoring and held-out evaluation.")
    )
    held_out_tokens: int | None = field(
        default=None,
        metadata=doc("Held-out tokens used for scoring and evaluation (null: the whole held-out split)."),
    )
    cache_dir: Path | None = field(
        default=None,
        metadata=doc("Where tokenised sources are cached (null: tokens/ in the run directory)."),
    )

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("expected at least one data source", "sources")
        _at_least(self, "seq_len", 1)
        _at_least(self, "batch_size", 1)
        _at_least(self, "eval_batch_size", 1)
        if self.held_out_tokens is not None:
            _at_least(self, "held_out_tokens", 1)
        if not 0 < self.held_out_fraction < 1:
            raise ConfigError(
                f"expected a fraction in (0, 1), got {self.held_out_fraction!r}", "held_out_fraction"
            )
        if not 0 <= self.test_fraction < self.held_out_fraction:
            raise ConfigError(
                f"expected a fraction in [0, held_out_fraction = {self.held_out_fraction}) (the test documents "
                f"are some of the held-out ones), got {self.test_fraction!r}",
                "test_fraction",
            )

    def token_data_kwargs(self, tokenizer: Path | None) -> dict[str, Any]:
        """Keyword arguments of `puzzle.data.TokenData.load` for these settings and `tokenizer`."""
        return {
            "sources": list(self.sources),
            "seq_len": self.seq_len,
            "tokenizer": tokenizer,
            "cache_dir": self.cache_dir,
            "text_field": self.text_field,
            "tensor_name": self.tensor_name,
            "dataset_split": self.dataset_split,
            "held_out_fraction": self.held_out_fraction,
            "split_seed": self.split_seed,
            "test_fraction": self.test_fraction,
        }


def _at_least(owner: Any, name: str, minimum: float) -> None:
    value = getattr(owner, name)
    if value < minimum:
        if isinstance(value, float):
            what = f"a number >= {minimum}"
        else:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"expected {what}, got {value!r}", name)


@dataclass(frozen=True)
class ImportanceConfig:
    """Activation importance of the parent's units (`puzzle.prune.importance`), which child init reads."""

    tokens: int = field(default=1_000_000, metadata=doc("Calibration tokens, from the train split."))
    batch_size: int = field(default=8, metadata=doc("Sequences per calibration batch."))
    linear_fit: bool = field(
        default=True, metadata=doc("Also collect the sums for linear-replacement variants.")
    )
    linear_fit_every: int = field(default=8, metadata=doc("Use every k-th token for the linear fit's sums."))
    shard: str = field(
        default="fsdp",
        metadata=doc(
            "fsdp: the parent sharded over the ranks with FSDP2, each rank running its own batches; hsdp: "
            "sharded inside a node, replicated across nodes; none: the whole parent on every rank."
        ),
    )

    def __post_init__(self) -> None:
        for name in ("tokens", "batch_size", "linear_fit_every"):
            _at_least(self, name, 1)
        check_shard_mode("ImportanceConfig.shard", self.shard)


@dataclass(frozen=True)
class RerankConfig:
    """Re-ranking of the search's candidates (`search.rerank` as a mapping). By a short GKD, the candidates
    are the MIP's k best, the children of the rounds of `search.context_rounds` (those the guard took) and the
    baselines' children at the same budgets (refilled greedy, the best uniform pruning), identical children
    once; each is distilled for a few tokens of GKD (the `gkd` section's settings otherwise), its KL to the
    parent measured on the held-out tokens after it, and the least kept as the budget's solution, which the
    distill stage then distils in full. Each candidate's short GKD is cached under solutions/rerank/{name}/
    and resumes from its checkpoints (gkd.checkpoint_every); the run's record lists every candidate with its
    sources, prediction and KL before and after the short GKD, and the report how often each source won."""

    by: Literal["measured", "short_gkd"] = field(
        default="short_gkd",
        metadata=doc(
            "short_gkd: the KL after a short GKD of each candidate; measured: the KL before GKD of the MIP's "
            "candidates (as `rerank: K`)."
        ),
    )
    candidates: int = field(default=5, metadata=doc("The MIP's K best architectures among the candidates."))
    tokens: float = field(
        default=0.25,
        metadata=doc(
            "by short_gkd: the tokens of each candidate's GKD, a fraction of the full GKD's (<= 1: of "
            "gkd.token_budget, or of gkd.steps' tokens) or a count of tokens (> 1); at least one optimiser step."
        ),
    )

    def __post_init__(self) -> None:
        _at_least(self, "candidates", 1)
        if not self.tokens > 0:
            raise ConfigError(
                f"expected a fraction in (0, 1] or a token count > 1, got {self.tokens!r}", "tokens"
            )
        if self.tokens > 1 and not float(self.tokens).is_integer():
            raise ConfigError(f"expected a whole number of tokens (> 1), got {self.tokens!r}", "tokens")


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache the children are served with (`puzzle.kv_cache`), as the cost model's `kv_dtype` prices it."""

    dtype: Literal["bf16", "fp8"] = field(
        default="bf16",
        metadata=doc(
            "bf16: the model's own dtype. fp8: per attention layer, static k and v scales (amax / 448 of its "
            "keys and values on calibration tokens of the train split) calibrated on each child; its measured "
            "KL, GKD and export run with keys and values fake-quantized to fp8 E4M3, and the export carries "
            "compressed-tensors' kv_cache_scheme and the scales, which vLLM loads (serve it with "
            "--kv-cache-dtype fp8). Every hardware scenario must then price its KV cache in fp8 (kv_dtype: fp8)."
        ),
    )
    tokens: int = field(default=65_536, metadata=doc("Calibration tokens for the KV scales."))

    def __post_init__(self) -> None:
        _at_least(self, "tokens", 1)


@dataclass(frozen=True)
class SearchConfig:
    """The architecture search: budgets (or a sweep of one budget), the score to optimise, rules, solver."""

    budgets: tuple[str, ...] = field(
        default_factory=tuple,
        metadata=doc(
            "Budgets in `puzzle search` syntax over the run's budget keys (see Budgets below): "
            "`active_params<=0.6x`, `throughput[chat]>=1.5x`, `memory_bytes[long]<=70G`."
        ),
    )
    sweep: str | None = field(
        default=None,
        metadata=doc(
            "Solve once per value of one budget, `KEY<=v1,v2,...` (`KEY>=...` for lower bounds); the other "
            "budgets hold at every point."
        ),
    )
    objective: Literal["kl", "lm_loss_delta", "hidden_nmse", "top1", "top5"] = field(
        default="kl",
        metadata=doc(
            "The replacement score summed over blocks, minimised: kl, lm_loss_delta, hidden_nmse, or for "
            "agreements the disagreement top1 = 1 - top-1 agreement, top5 = 1 - top-5 agreement."
        ),
    )
    solutions: int = field(default=1, metadata=doc("The K best distinct architectures per budget."))
    min_diff: int = field(
        default=1,
        metadata=doc(
            "With solutions > 1 or rerank > 1: blocks in which each solution differs from every other."
        ),
    )
    rerank: int | RerankConfig = field(
        default=0,
        metadata=doc(
            "Re-ranking of the search's candidates by measurement. An integer K: the MIP's K best architectures "
            "(each differing from the others in >= min_diff blocks) are assembled, their KL to the parent "
            "measured on the held-out tokens, and the least measured kept as the budget's solution (costs K "
            "child forwards over the held-out set per budget); 0 or 1: off, the MIP's best is the solution. A "
            "mapping `{by: short_gkd, tokens: T, candidates: K}` (`search.rerank` below): each candidate is "
            "distilled shortly and the least KL after it kept."
        ),
    )
    context_rounds: int = field(
        default=0,
        metadata=doc(
            "Scores in context: after the first solve, rescore every block's variants in the solved child "
            "(KL to the parent, relative to the child's own) and solve again, up to this many rounds or until "
            "the choice repeats; the best measured round's architecture is kept. 0: off."
        ),
    )
    context_changes: int = field(
        default=0,
        metadata=doc(
            "Scores in context: at most this many blocks change from the child in each round (a trust region: "
            "the rescored values are exact for one change, a first-order expansion for several). 0: no bound."
        ),
    )
    context_guard: float = field(
        default=3.0,
        metadata=doc(
            "Scores in context: a round whose predicted objective is below zero (kl, hidden_nmse, top1, top5) "
            "or more than this factor above or below what the child it starts from measured is not taken: the "
            "rounds stop and the best child measured so far is kept; the reason is logged and recorded in the "
            "solutions record's `context` (`stopped`: the round; its `rejected`: why). 0: off."
        ),
    )
    shared_state_size: bool = field(
        default=True, metadata=doc("One SSM state size for every Mamba block (serving engines need it).")
    )
    same_attributes: tuple[Literal["state_size", "top_k", "kind"], ...] = field(
        default_factory=tuple,
        metadata=doc("Attributes held to one value over the chosen variants that have them (e.g. [top_k])."),
    )
    keep_blocks: tuple[int, ...] = field(
        default_factory=tuple, metadata=doc("Blocks held at the parent's shape.")
    )
    engines: tuple[Literal["vllm", "llama.cpp", "transformers", "sglang", "trtllm"], ...] = field(
        default_factory=tuple,
        metadata=doc(
            "Serving engines the child must load (e.g. [vllm]): the search leaves out the variants they refuse "
            "(no-op and linear blocks, a width per expert...) and holds what they read from the config's "
            "globals to one value (vLLM: one Mamba and one attention shape), so the child exports with "
            "format: engine. Empty: every variant."
        ),
    )
    solver: SolverOptions = field(default_factory=SolverOptions, metadata=doc("MIP solver options."))

    def __post_init__(self) -> None:
        # Each budget is read in RunConfig, which knows the scenarios (hardware.scenarios) they name.
        self.swept()
        _at_least(self, "solutions", 1)
        _at_least(self, "min_diff", 1)
        if not isinstance(self.rerank, RerankConfig):
            _at_least(self, "rerank", 0)
        _at_least(self, "context_rounds", 0)
        _at_least(self, "context_changes", 0)
        # A factor is taken both ways (max of predicted/measured and its inverse), so only one above 1 means
        # anything; 1 itself would stop every round that changes the child.
        if not (self.context_guard == 0 or self.context_guard > 1):
            raise ConfigError(
                f"expected 0 (off) or a factor > 1, got {self.context_guard!r}", "context_guard"
            )
        if self.min_diff > 1 and self.solutions == 1 and self.reranking() is None:
            raise ConfigError("needs solutions > 1 or rerank > 1 (it spaces the solutions apart)", "min_diff")
        if self.sweep is not None and self.solutions > 1:
            raise ConfigError(
                "more than one solution does not combine with a sweep (one solution per point)", "solutions"
            )
        if any(block < 0 for block in self.keep_blocks):
            raise ConfigError(f"expected block indices >= 0, got {list(self.keep_blocks)}", "keep_blocks")

    def reranking(self) -> RerankConfig | None:
        """The re-ranking asked for: `rerank: K` (K > 1) as `{by: measured, candidates: K}`, a mapping as it
        is, None when off (0 or 1)."""
        if isinstance(self.rerank, RerankConfig):
            return self.rerank
        return RerankConfig(by="measured", candidates=self.rerank) if self.rerank > 1 else None

    def candidates_wanted(self) -> int:
        """How many of the MIP's best architectures the search solves for: `solutions`, or the re-ranking's
        candidates where there are more."""
        reranking = self.reranking()
        return max(self.solutions, reranking.candidates if reranking is not None else 0)

    def swept(self) -> tuple[str, str, list[Value]] | None:
        """(key, side 'upper' / 'lower', values) of the sweep, or None."""
        if self.sweep is None:
            return None
        try:
            key, side, values = parse_sweep(self.sweep)
        except BudgetError as error:
            raise ConfigError(str(error), "sweep") from None
        return key, side, values


@dataclass(frozen=True)
class RoundsConfig:
    """Iterative Puzzle: the distilled child of round r is the parent of round r + 1."""

    count: int = field(default=1, metadata=doc("Rounds of importance, library, scores, search and GKD."))
    budgets: tuple[tuple[str, ...], ...] | None = field(
        default=None,
        metadata=doc(
            "One list of budgets per round (required when count > 1; then search.budgets and search.sweep "
            "stay empty). Relative values are factors of that round's parent."
        ),
    )

    pick: int = field(
        default=1,
        metadata=doc(
            "Which of a round's solutions (1 = the first: the first budget list's best) becomes the next "
            "round's parent, when a round has several (search.solutions > 1)."
        ),
    )

    def __post_init__(self) -> None:
        _at_least(self, "count", 1)
        _at_least(self, "pick", 1)
        if self.budgets is None:
            if self.count > 1:
                raise ConfigError(
                    f"{self.count} rounds need budgets: one list of budgets per round", "budgets"
                )
            return
        if len(self.budgets) != self.count:
            raise ConfigError(
                f"expected one list of budgets per round ({self.count}), got {len(self.budgets)}", "budgets"
            )
        for round_index, texts in enumerate(self.budgets):
            if not texts:  # each budget is read in RunConfig, which knows the scenarios
                raise ConfigError("expected at least one budget", f"budgets[{round_index}]")


@dataclass(frozen=True)
class EvalConfig:
    """Task accuracy of the parent and the children through lm-evaluation-harness (`puzzle.eval`)."""

    tasks: tuple[str, ...] = field(
        default_factory=tuple,
        metadata=doc(
            "lm-eval task names (its registry's, the local puzzle_next_line and puzzle_identifiers, or those "
            "under include_path) on which `puzzle run` evaluates the parent and every child, assembled and "
            "distilled, into eval/{model}.json; the report tabulates them. Empty: no evaluation. Needs the "
            "eval extra."
        ),
    )
    limit: int | None = field(
        default=None, metadata=doc("At most this many documents per task (null: every document).")
    )
    batch_size: int = field(default=8, metadata=doc("Requests per forward (lm-eval's batch size)."))
    include_path: Path | None = field(
        default=None,
        metadata=doc("A folder of extra lm-eval task YAMLs and their local data files (null: none)."),
    )

    def __post_init__(self) -> None:
        for index, task in enumerate(self.tasks):
            if not task.strip() or "," in task:
                raise ConfigError(f"expected one task name, got {task!r}", f"tasks[{index}]")
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"a task is named twice: {list(self.tasks)}", "tasks")
        if self.limit is not None:
            _at_least(self, "limit", 1)
        _at_least(self, "batch_size", 1)

    def check_tasks(self) -> None:
        """ConfigError (naming eval.tasks or eval.include_path) unless lm-eval is installed and knows every
        task: checked before a run starts, as indexing the tasks takes seconds and a run hours."""
        if not self.tasks:
            return
        if self.include_path is not None and not self.include_path.is_dir():
            raise ConfigError(f"task folder {self.include_path} does not exist", "eval.include_path")
        from puzzle.eval import EvalError, UnknownTaskError, check_tasks, task_manager

        try:
            check_tasks(list(self.tasks), task_manager(self.include_path))
        except UnknownTaskError as error:
            where = f"eval.tasks[{self.tasks.index(error.name)}]"
            raise ConfigError(str(error), where) from None
        except EvalError as error:
            raise ConfigError(str(error), "eval.tasks") from None


@dataclass(frozen=True)
class RunConfig:
    """A whole Puzzle run: one YAML file. Relative paths are relative to the file's folder."""

    run_dir: Path = field(
        metadata=doc("The run directory: every stage's outputs, logs and the config the run started with.")
    )
    parent: ParentConfig = field(metadata=doc("The model to compress."))
    data: DataConfig = field(metadata=doc("Training and held-out tokens."))
    space: SearchSpace | str = field(
        metadata=doc(
            "The search space: a preset name (nemotron3-super), a path to a space YAML file, or the space "
            "itself inline (the schema of puzzle/space.py, below)."
        )
    )
    tokenizer: Path | None = field(
        default=None, metadata=doc("Directory with the tokenizer files (null: the parent's directory).")
    )
    importance: ImportanceConfig = field(
        default_factory=ImportanceConfig, metadata=doc("Activation importance.")
    )
    bld: BLDSettings = field(
        default_factory=BLDSettings, metadata=doc("Blockwise local distillation (puzzle.bld.BLDSettings).")
    )
    scoring: ScoreSettings = field(
        default_factory=ScoreSettings,
        metadata=doc("Replace-one-block scoring (puzzle.score.ScoreSettings)."),
    )
    search: SearchConfig = field(default_factory=SearchConfig, metadata=doc("The architecture search."))
    gkd: GKDSettings = field(
        default_factory=GKDSettings,
        metadata=doc("Global knowledge distillation of the child (puzzle.gkd.GKDSettings)."),
    )
    rounds: RoundsConfig = field(default_factory=RoundsConfig, metadata=doc("Iterative Puzzle rounds."))
    eval: EvalConfig = field(
        default_factory=EvalConfig,
        metadata=doc("Task accuracy of the parent and the children (lm-evaluation-harness)."),
    )
    hardware: CostModel = field(default_factory=CostModel, metadata=doc("Serving hardware and scenarios."))
    kv_cache: KVCacheConfig = field(
        default_factory=KVCacheConfig,
        metadata=doc("The children's served KV cache (fp8: calibrated scales)."),
    )
    seed: int = field(
        default=0,
        metadata=doc(
            "The run's seed: the default of bld.seed and gkd.seed where those are not given, and the seed "
            "of every other random choice of the run (the held-out split has its own, data.split_seed)."
        ),
    )

    # Per round, per solve: the budgets as read in __post_init__ (`round_limits`); set on the instance, not
    # a field, so that the config's keys, equality and dump stay those of the YAML file.
    _solves: ClassVar[tuple[tuple[tuple[DeploymentLimit, ...], ...], ...]]

    def __post_init__(self) -> None:
        if isinstance(self.space, str) and not self.space.strip():
            raise ConfigError(
                "expected a preset name, a file or an inline space, got an empty string", "space"
            )
        _at_least(self, "seed", 0)
        search, rounds = self.search, self.rounds
        if rounds.budgets is not None and (search.budgets or search.sweep):
            raise ConfigError(
                "give the budgets either per round (rounds.budgets) or in search.budgets / search.sweep, "
                "not both",
                "rounds.budgets",
            )
        if rounds.count > 1 and search.sweep:
            raise ConfigError("a sweep does not combine with several rounds", "search.sweep")
        if rounds.budgets is None and not search.budgets and not search.sweep:
            raise ConfigError(
                "no budget: give search.budgets (e.g. ['active_params<=0.6x']), search.sweep or "
                "rounds.budgets",
                "search.budgets",
            )
        selected = self.gkd.select_task
        if selected is not None and selected[0] not in self.eval.tasks:
            raise ConfigError(
                f"{self.gkd.select_by!r} names task {selected[0]!r}, which eval.tasks does not list "
                f"({list(self.eval.tasks)}): GKD scores it with the eval section's limit and batch size",
                "gkd.select_by",
            )
        if self.kv_cache.dtype == "fp8":  # the children are served so: the search must price their KV so too
            for name, scenario in self.hardware.scenarios.items():
                if scenario.kv_dtype != "fp8":
                    raise ConfigError(
                        f"kv_cache.dtype is fp8 but scenario {name!r} prices the KV cache in {scenario.kv_dtype}; "
                        "set its kv_dtype: fp8",
                        f"hardware.scenarios.{name}.kv_dtype",
                    )
        # Every budget is read here, once: the search takes these objects (`round_limits`).
        solves = [self._read_solves(r) for r in range(rounds.count)]
        object.__setattr__(self, "_solves", tuple(solves))

    def _read(self, text: str, where: str) -> DeploymentLimit:
        try:
            return parse_budget(text, self.hardware)
        except ConfigError as error:
            raise error.within(where) from None

    def _read_solves(self, round_index: int) -> tuple[tuple[DeploymentLimit, ...], ...]:
        """Round `round_index`'s budgets, one tuple per solve (one per sweep value, the swept value replacing
        any budget on the same key), each budget read against the `hardware` scenarios."""
        if self.rounds.budgets is not None:
            where = f"rounds.budgets[{round_index}]"
            texts = self.rounds.budgets[round_index]
            return (tuple(self._read(text, f"{where}[{i}]") for i, text in enumerate(texts)),)
        given = [self._read(text, f"search.budgets[{i}]") for i, text in enumerate(self.search.budgets)]
        swept = self.search.swept()
        if swept is None:
            return (tuple(given),)
        key, side, values = swept
        kept = tuple(limit for limit in given if limit.name != key)
        points = (self._read(_sweep_budget(key, side, value), "search.sweep") for value in values)
        return tuple((*kept, point) for point in points)

    # -- what the stages read -------------------------------------------------------------------------

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer's directory: `tokenizer`, else the parent's."""
        return self.tokenizer if self.tokenizer is not None else self.parent.path

    def search_space(self) -> SearchSpace:
        """The SearchSpace: the inline one, the preset, or the file (ConfigError naming `space` otherwise)."""
        if isinstance(self.space, SearchSpace):
            return self.space
        if _is_space_preset(self.space):
            return get_space_preset(self.space)
        path = Path(self.space)
        if not path.is_file():
            raise ConfigError(
                f"{self.space!r} is neither a search space preset ({', '.join(sorted(SPACE_PRESETS))}) nor "
                "an existing file",
                "space",
            )
        # Read as the config is (duplicate keys refused), so that an error names the space file's own line.
        data, lines = read_yaml(path)
        try:
            return SearchSpace.from_dict({} if data is None else data)
        except ValueError as error:  # its messages name the key's path under `space`
            at = error_key(error, "space").removeprefix("space").lstrip(".")
            raise ConfigError(str(error), file=path, line=line_of(at, lines)) from None

    def round_limits(self, round_index: int = 0) -> list[list[DeploymentLimit]]:
        """The budgets of round `round_index` as the search takes them (`puzzle.search.budget.DeploymentLimit`,
        read once when the config was loaded), one list per solve (one per sweep value, the swept value
        replacing any budget on the same key)."""
        if not 0 <= round_index < self.rounds.count:
            raise IndexError(f"round {round_index} of a {self.rounds.count}-round run")
        return [list(solve) for solve in self._solves[round_index]]

    def round_budgets(self, round_index: int = 0) -> list[list[str]]:
        """`round_limits` as `puzzle search` texts."""
        return [[limit.text for limit in solve] for solve in self.round_limits(round_index)]

    # -- checks against the disk ----------------------------------------------------------------------

    def validate_paths(self) -> ModelSpec:
        """Check what the run will read, without loading a weight; returns the parent's ModelSpec.

        The parent directory holds a readable NemotronH config.json and complete safetensors weights (their
        headers read, never the tensors); the tokenizer directory holds tokenizer files (when a source is
        text); every data source exists (token files with complete headers); the space file (if any) is a
        valid space whose variants fit the parent's blocks; the run directory and the token cache can be
        created and written, and lie outside the parent's directory and the folders of the data; kept
        blocks exist. `puzzle config check` and `puzzle run` (before any stage) both call this: what one
        accepts the other does not refuse for its inputs. Raises ConfigError naming the key.
        """
        from puzzle import data as token_data
        from puzzle import nemotron_h
        from puzzle.nemotron_h.weights import check_safetensors_file, weight_files

        parent = self.parent.path
        try:
            spec = nemotron_h.spec_from_config(
                nemotron_h.read_config(parent), str(parent / nemotron_h.CONFIG_NAME)
            )
            for file in weight_files(parent):
                check_safetensors_file(file)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error), "parent.path") from None
        try:
            sources = token_data.resolve_sources(self.data.sources)
            for file in sources:
                if file.is_file() and file.suffix.lower() in token_data.TOKEN_SUFFIXES:
                    check_safetensors_file(file)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error), "data.sources") from None
        needs_tokenizer = any(
            not (p.is_file() and p.suffix.lower() in token_data.TOKEN_SUFFIXES) for p in sources
        )
        tokenizer_key = "tokenizer" if self.tokenizer is not None else "parent.path"
        if self.tokenizer is not None and not self.tokenizer.is_dir():
            raise ConfigError(f"tokenizer directory {self.tokenizer} does not exist", "tokenizer")
        if needs_tokenizer and not token_data.tokenizer_files(self.tokenizer_dir):
            raise ConfigError(
                f"no tokenizer files in {self.tokenizer_dir} (expected one of "
                f"{', '.join(token_data.TOKENIZER_FILES)}); the text sources need one: set `tokenizer:`",
                tokenizer_key,
            )
        self._check_output_dirs(sources)
        space = self.search_space()
        if not any(kind.profiles for kind in space.kinds.values()) and not any(
            o.space is not None and o.space.profiles for o in space.overrides
        ):  # width profiles need the parent's importance: checked when it is measured
            try:
                space.all_variants(spec)
            except ValueError as error:
                raise ConfigError(str(error), "space") from None
        beyond = [b for b in self.search.keep_blocks if b >= spec.num_blocks]
        if beyond:
            raise ConfigError(
                f"blocks {beyond} do not exist: the parent has {spec.num_blocks}", "search.keep_blocks"
            )
        self.eval.check_tasks()
        return spec

    def _check_output_dirs(self, sources: list[Path]) -> None:
        """The run directory and the token cache: outside the parent, directories that can be created and
        written, and the cache (data.cache_dir, else tokens/ in the run directory) outside the inputs
        themselves (the rule `puzzle.data.TokenData.load` enforces, checked here before anything runs)."""
        from puzzle import data as token_data

        parent = self.parent.path
        resolved_parent = parent.resolve()
        for key, path in (("run_dir", self.run_dir), ("data.cache_dir", self.data.cache_dir)):
            if path is None:
                continue
            resolved = path.resolve()
            if resolved == resolved_parent or resolved_parent in resolved.parents:
                raise ConfigError(
                    f"{path} is inside the parent checkpoint {parent}, which is never written to", key
                )
            problem = _unwritable(path)
            if problem is not None:
                raise ConfigError(problem, key)
        # The tokenizer the run reads (puzzle.run.Run.data): the configured one, else the parent's if it has one.
        tokenizer = self.tokenizer_dir
        if self.tokenizer is None and not token_data.tokenizer_files(tokenizer):
            tokenizer = None
        cache = self.data.cache_dir if self.data.cache_dir is not None else self.run_dir / "tokens"
        place = token_data.input_holding(cache, self.data.sources, tokenizer)
        if place is not None:
            key = "data.cache_dir" if self.data.cache_dir is not None else "run_dir"
            what = "the token cache" if self.data.cache_dir is not None else f"its token cache {cache}"
            raise ConfigError(
                f"{what} would be or lie inside {place}, an input of the run (a data source or the "
                "tokenizer); choose a directory outside it, so that the run's files never mix with its inputs",
                key,
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data: `load_config_data(to_dict())` equals this config."""
        return to_dict(self)


def _unwritable(directory: Path) -> str | None:
    """Why the run cannot create or write `directory` (a sentence), or None. Asks the system (os.access)
    about the directory, or the nearest folder above it that exists, where it will be made; writes
    nothing."""
    if directory.exists():
        if not directory.is_dir():
            return f"{directory} exists and is not a directory"
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"{directory} is not writable (no write permission)"
        return None
    above = next((p for p in directory.absolute().parents if p.exists()), None)
    if above is None or not above.is_dir():
        return f"{directory} cannot be created: {above} is not a directory"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"{directory} cannot be created: {above} is not writable (no write permission)"
    return None


def load_config_data(
    data: Any, base_dir: str | Path | None = None, *, file: str | Path | None = None
) -> RunConfig:
    """A RunConfig from plain data (a parsed YAML mapping); `base_dir` resolves relative paths."""
    if data is None:
        raise ConfigError(
            "the config is empty; expected a mapping with keys " + ", ".join(_run_keys()), file=file
        )
    seed = data.get("seed") if isinstance(data, Mapping) else None
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:  # the stages' seeds default
        for section in ("bld", "gkd"):
            settings = data.get(section, {})
            if isinstance(settings, Mapping) and "seed" not in settings:
                data = {**data, section: {**settings, "seed": seed}}
    config = from_data(RunConfig, data, "", base_dir)
    if isinstance(config.space, str) and not _is_space_preset(config.space):  # a file, like other paths
        path = Path(config.space).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        config = dataclasses.replace(config, space=str(path))
    return config


def _is_space_preset(name: str) -> bool:
    return name.strip().lower().replace("_", "-") in SPACE_PRESETS


def _run_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


def load_config(path: str | Path, *, check_paths: bool = False) -> RunConfig:
    """Read and validate the run config at `path` (YAML). Relative paths in it are relative to its folder.

    With `check_paths`, also `RunConfig.validate_paths()`. Raises ConfigError naming the file, the line and
    the key's path.
    """
    path = Path(path)
    data, lines = read_yaml(path)
    try:
        config = load_config_data(data, path.parent, file=path)
        if check_paths:
            config.validate_paths()
    except ConfigError as error:
        if error.file is not None:
            raise
        raise ConfigError(error.message, error.key, path, line_of(error.at or error.key, lines)) from None
    return config


def dump_config(config: RunConfig) -> str:
    """The config as YAML (every field, defaults included): what `load_config` reads back equal."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)
