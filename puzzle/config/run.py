"""The run config: one YAML file describing a whole Puzzle run, loaded into `RunConfig` with strict validation.

`load_config(path)` reads and validates it (types, values, budgets against the scenarios, rounds);
`RunConfig.validate_paths()` checks what it names on disk (the parent's config.json and weights, the
tokenizer, the data, the space file) without loading a weight. Sections reuse the stages' own settings
where they exist (`puzzle.bld.BLDSettings`, `puzzle.score.ScoreSettings`, `puzzle.search.SolverOptions`,
`puzzle.cost.Scenario`). Budgets are texts in the syntax of `puzzle search RUN_DIR` over deployment keys
(`BUDGET_KEYS`: `active_params<=0.6x`, `throughput[chat]>=1.5x`), checked here and handed to the search
as written (`RunConfig.round_budgets`), with the cost model of the `hardware` section.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from puzzle.bld import BLDSettings
from puzzle.config.loader import ConfigError, doc, from_data, line_of, read_yaml, to_dict
from puzzle.cost.analytic import get_recipe
from puzzle.cost.hardware import hardware_key
from puzzle.cost.roofline import Scenario
from puzzle.presets import SPACE_PRESETS, get_space_preset
from puzzle.score import ScoreSettings
from puzzle.search.frontier import parse_sweep
from puzzle.search.limits import BudgetError, Limit, Relative, Value, parse_limit
from puzzle.search.types import SolverOptions
from puzzle.space import SearchSpace
from puzzle.spec import ModelSpec

# Budget keys, as `puzzle search RUN_DIR` reads them (puzzle/search/run_dir.py): key -> (the bound it takes,
# whether it names scenarios, what it bounds). `KEY[S]` names one or more scenarios of hardware.scenarios
# (`throughput[chat,long]>=1.5x`: the bound holds in each). Values are absolute (7e9, 70G) or factors of the
# round's parent (0.6x; for throughput, 1.5x is 1.5 times the parent's tokens/s).
BUDGET_KEYS: dict[str, tuple[str, bool, str]] = {
    "params": ("<=", False, "total parameters"),
    "active_params": ("<=", False, "parameters used per token"),
    "weight_bytes": ("<=", False, "weight bytes in hardware.recipe"),
    "memory_bytes": ("<=", True, "weights + the batch's KV cache and recurrent state at the scenario, bytes"),
    "concurrent_requests": (
        ">=",
        True,
        "requests of the scenario's context that fit beside the weights in hardware.memory_fraction of "
        "the profile's memory (a whole number)",
    ),
    "throughput": (">=", True, "output tokens/s of the scenario's batch on hardware.profile (roofline)"),
    "latency": ("<=", True, "seconds for the scenario's batch (prefill + generation)"),
    "ttft": ("<=", True, "seconds to the first token (the batch's prefill)"),
}
_BUDGET_KEY = re.compile(r"(\w+)(?:\[([^\[\]]*)\])?")


def parse_budget(text: str, scenarios: Mapping[str, Any] | None = None) -> tuple[Limit, tuple[str, ...]]:
    """A run budget (`active_params<=0.6x`, `throughput[chat,long]>=1.5x`): its Limit and the scenarios it
    names, checked against `scenarios` when given. ConfigError (without a key path) if malformed."""
    try:
        limit = parse_limit(text)
    except BudgetError as error:
        raise ConfigError(str(error)) from None
    match = _BUDGET_KEY.fullmatch(limit.key)
    if match is None or match.group(1) not in BUDGET_KEYS:
        name = match.group(1) if match else limit.key
        close = difflib.get_close_matches(name, list(BUDGET_KEYS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        known = ", ".join(f"{key}[S]" if named else key for key, (_, named, _) in BUDGET_KEYS.items())
        raise ConfigError(f"unknown budget key {limit.key!r}; {hint}budget keys: {known}")
    key, listed = match.group(1), match.group(2)
    side, named, _ = BUDGET_KEYS[key]
    if named and not listed:
        raise ConfigError(
            f"{key} needs scenarios: {key}[NAME] or {key}[NAME,NAME] (names under hardware.scenarios)"
        )
    if not named and listed is not None:
        raise ConfigError(f"{key} takes no scenario (write {key}{side}VALUE)")
    names = tuple(name.strip() for name in listed.split(",")) if listed else ()
    if len(set(names)) != len(names):
        raise ConfigError(f"{text!r} names a scenario twice")
    for name in names if scenarios is not None else ():
        if name not in scenarios:
            defined = ", ".join(scenarios) or "none"
            raise ConfigError(
                f"scenario {name!r} is not defined under hardware.scenarios (defined: {defined})"
            )
    value, other = (limit.upper, limit.lower) if side == "<=" else (limit.lower, limit.upper)
    if value is None or other is not None:
        raise ConfigError(f"{key} takes only a bound {key}{side}VALUE")
    if key == "concurrent_requests" and (isinstance(value, Relative) or not float(value).is_integer()):
        raise ConfigError(
            f"concurrent_requests needs a whole number of requests (not a factor), found {text!r}"
        )
    if not isinstance(value, Relative) and value <= 0:
        raise ConfigError(f"the bound must be positive, found {text!r}")
    return limit, names


def _sweep_budget(key: str, side: str, value: Value) -> str:
    return str(Limit(key, **{side: value}))


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
        }


def _at_least(owner: Any, name: str, minimum: float) -> None:
    value = getattr(owner, name)
    if value < minimum:
        if isinstance(value, float):
            what = f"a number >= {minimum}"
        else:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"expected {what}, got {value!r}", name)


def _positive(owner: Any, name: str) -> None:
    value = getattr(owner, name)
    if not value > 0:
        raise ConfigError(f"expected a positive number, got {value!r}", name)


@dataclass(frozen=True)
class ImportanceConfig:
    """Activation importance of the parent's units (`puzzle.prune.importance`), which child init reads."""

    tokens: int = field(default=1_000_000, metadata=doc("Calibration tokens, from the train split."))
    batch_size: int = field(default=8, metadata=doc("Sequences per calibration batch."))
    linear_fit: bool = field(
        default=True, metadata=doc("Also collect the sums for linear-replacement variants.")
    )
    linear_fit_every: int = field(default=8, metadata=doc("Use every k-th token for the linear fit's sums."))

    def __post_init__(self) -> None:
        for name in ("tokens", "batch_size", "linear_fit_every"):
            _at_least(self, name, 1)


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
        metadata=doc("With solutions > 1: blocks in which each solution differs from every other."),
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
    solver: SolverOptions = field(default_factory=SolverOptions, metadata=doc("MIP solver options."))

    def __post_init__(self) -> None:
        for index, text in enumerate(self.budgets):
            try:
                parse_budget(text)
            except ConfigError as error:
                raise error.within(f"budgets[{index}]") from None
        self.swept()
        _at_least(self, "solutions", 1)
        _at_least(self, "min_diff", 1)
        if self.min_diff > 1 and self.solutions == 1:
            raise ConfigError("needs solutions > 1 (it spaces the solutions apart)", "min_diff")
        if self.sweep is not None and self.solutions > 1:
            raise ConfigError(
                "more than one solution does not combine with a sweep (one solution per point)", "solutions"
            )
        if any(block < 0 for block in self.keep_blocks):
            raise ConfigError(f"expected block indices >= 0, got {list(self.keep_blocks)}", "keep_blocks")

    def swept(self) -> tuple[str, str, list[Value]] | None:
        """(key, side 'upper' / 'lower', values) of the sweep, or None."""
        if self.sweep is None:
            return None
        try:
            key, side, values = parse_sweep(self.sweep)
        except BudgetError as error:
            raise ConfigError(str(error), "sweep") from None
        for value in values:  # each point is a budget like any other
            try:
                parse_budget(_sweep_budget(key, side, value))
            except ConfigError as error:
                raise error.within("sweep") from None
        return key, side, values


@dataclass(frozen=True)
class GKDConfig:
    """Global knowledge distillation of the assembled child against the parent: KL on the logits plus
    (1 - cosine) of hidden states per block. A placeholder with the fields of `puzzle.gkd.GKDSettings`
    (written alongside), which replaces it. Token counts and batch_size are global (all ranks together)."""

    lr: float = field(default=1e-5, metadata=doc("AdamW peak learning rate."))
    min_lr_ratio: float = field(
        default=0.1, metadata=doc("The learning rate at the end of the cosine decay, as a fraction of lr.")
    )
    warmup_tokens: int = field(default=0, metadata=doc("Linear warm-up from 0 over this many tokens."))
    weight_decay: float = field(default=0.0, metadata=doc("AdamW weight decay."))
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=doc("AdamW betas."))
    token_budget: int | None = field(
        default=100_000_000,
        metadata=doc("Tokens to train on (null: no token limit; the run also ends after `steps`)."),
    )
    steps: int | None = field(
        default=None, metadata=doc("Optimiser steps (null: no step limit); at least one limit is needed.")
    )
    batch_size: int = field(default=8, metadata=doc("Sequences per optimiser step."))
    micro_batch_size: int | None = field(
        default=None,
        metadata=doc(
            "Sequences per forward/backward on one rank (null: the rank's whole share); gradients "
            "accumulate over the share."
        ),
    )
    clip: float = field(default=1.0, metadata=doc("Max global gradient norm (0: none)."))
    kl_weight: float = field(default=1.0, metadata=doc("Weight of the logit KL to the parent."))
    cosine_weight: float = field(
        default=1.0, metadata=doc("Weight of the per-block (1 - cosine) of hidden states.")
    )
    lm_weight: float = field(
        default=0.0,
        metadata=doc("Weight of the LM loss (off by default: the Puzzle ablation found it hurts)."),
    )
    vocab_chunk: int = field(default=4096, metadata=doc("lm_head rows per KL chunk (peak memory)."))
    eval_every: int = field(
        default=100, metadata=doc("Steps between held-out evaluations (0: only before and after).")
    )
    checkpoint_every: int = field(default=100, metadata=doc("Steps between checkpoints (0: never)."))
    seed: int = field(default=0, metadata=doc("Seeds torch and the order of the batches."))
    dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata=doc("The student's training dtype.")
    )
    autocast: bool = field(default=True, metadata=doc("bf16 autocast on CUDA."))
    shard: Literal["fsdp", "none"] = field(
        default="fsdp",
        metadata=doc("fsdp: shard student and teacher over the ranks with FSDP2; none: replicate them."),
    )

    def __post_init__(self) -> None:
        _positive(self, "lr")
        for name in ("min_lr_ratio", "weight_decay", "clip", "kl_weight", "cosine_weight", "lm_weight"):
            _at_least(self, name, 0)
        if self.min_lr_ratio > 1:
            raise ConfigError(f"expected a fraction in [0, 1], got {self.min_lr_ratio!r}", "min_lr_ratio")
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"expected two numbers in [0, 1), got {list(self.betas)}", "betas")
        for name in ("warmup_tokens", "eval_every", "checkpoint_every", "seed"):
            _at_least(self, name, 0)
        for name in ("token_budget", "steps", "micro_batch_size"):
            if getattr(self, name) is not None:
                _at_least(self, name, 1)
        for name in ("batch_size", "vocab_chunk"):
            _at_least(self, name, 1)
        if self.token_budget is None and self.steps is None:
            raise ConfigError("token_budget and steps are both null: set at least one", "token_budget")
        if self.micro_batch_size is not None and self.micro_batch_size > self.batch_size:
            raise ConfigError(
                f"expected at most batch_size ({self.batch_size}), got {self.micro_batch_size}",
                "micro_batch_size",
            )
        if self.kl_weight + self.cosine_weight + self.lm_weight == 0:
            raise ConfigError(
                "kl_weight, cosine_weight and lm_weight are all 0: nothing to train", "kl_weight"
            )


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

    def __post_init__(self) -> None:
        _at_least(self, "count", 1)
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
            if not texts:
                raise ConfigError("expected at least one budget", f"budgets[{round_index}]")
            for index, text in enumerate(texts):
                try:
                    parse_budget(text)
                except ConfigError as error:
                    raise error.within(f"budgets[{round_index}][{index}]") from None


@dataclass(frozen=True)
class HardwareConfig:
    """Where the child will be served: the accelerator profile (roofline timing, memory) and the named
    serving scenarios that budgets refer to (`throughput[chat]`)."""

    profile: str = field(
        default="h100-80gb",
        metadata=doc(
            "Accelerator profile of puzzle.cost (h100-80gb, h200-141gb, b200, a100-80gb, this-machine; "
            "aliases such as h100 accepted)."
        ),
    )
    memory_fraction: float = field(
        default=0.9, metadata=doc("Share of the device memory usable for weights and requests.")
    )
    recipe: str = field(
        default="bf16", metadata=doc("Weight storage for weight_bytes budgets (bf16, fp8, nvfp4, ...).")
    )
    scenarios: dict[str, Scenario] = field(
        default_factory=dict,
        metadata=doc(
            "Serving scenarios by name: batch_size, prompt_tokens, generated_tokens and dtypes (see Scenario)."
        ),
    )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "profile", hardware_key(self.profile))
        except ValueError as error:
            raise ConfigError(str(error), "profile") from None
        try:
            get_recipe(self.recipe)
        except ValueError as error:
            raise ConfigError(str(error), "recipe") from None
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(
                f"expected a fraction in (0, 1], got {self.memory_fraction!r}", "memory_fraction"
            )
        named = {}
        for name, scenario in self.scenarios.items():
            if scenario.name not in ("", name):
                raise ConfigError(
                    f"name {scenario.name!r} differs from its key {name!r}", f"scenarios.{name}.name"
                )
            named[name] = dataclasses.replace(scenario, name=name)
        object.__setattr__(self, "scenarios", named)

    def cost_model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the search's cost model (`puzzle.search.run_dir.CostModel`)."""
        return {
            "hardware": self.profile,
            "recipe": self.recipe,
            "memory_fraction": self.memory_fraction,
            "scenarios": dict(self.scenarios),
        }


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
    gkd: GKDConfig = field(
        default_factory=GKDConfig, metadata=doc("Global knowledge distillation of the child.")
    )
    rounds: RoundsConfig = field(default_factory=RoundsConfig, metadata=doc("Iterative Puzzle rounds."))
    hardware: HardwareConfig = field(
        default_factory=HardwareConfig, metadata=doc("Serving hardware and scenarios.")
    )
    seed: int = field(
        default=0,
        metadata=doc(
            "The run's seed: the default of bld.seed and gkd.seed where those are not given, and the seed "
            "of every other random choice of the run (the held-out split has its own, data.split_seed)."
        ),
    )

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
        places = [("search.budgets", self.search.budgets)]
        places += [(f"rounds.budgets[{r}]", texts) for r, texts in enumerate(rounds.budgets or ())]
        for where, texts in places:
            for index, text in enumerate(texts):
                try:
                    parse_budget(text, self.hardware.scenarios)
                except ConfigError as error:
                    raise error.within(f"{where}[{index}]") from None
        swept = search.swept()
        if swept is not None:
            try:
                parse_budget(_sweep_budget(swept[0], swept[1], swept[2][0]), self.hardware.scenarios)
            except ConfigError as error:
                raise error.within("search.sweep") from None

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
        try:
            return SearchSpace.from_yaml(path)
        except ValueError as error:
            raise ConfigError(str(error), "space") from None

    def round_budgets(self, round_index: int = 0) -> list[list[str]]:
        """The budgets of round `round_index` as `puzzle search` texts, one list per solve (one per sweep
        value, the swept value replacing any budget on the same key)."""
        if not 0 <= round_index < self.rounds.count:
            raise IndexError(f"round {round_index} of a {self.rounds.count}-round run")
        if self.rounds.budgets is not None:
            return [list(self.rounds.budgets[round_index])]
        swept = self.search.swept()
        if swept is None:
            return [list(self.search.budgets)]
        key, side, values = swept
        kept = [text for text in self.search.budgets if parse_budget(text)[0].key != key]
        return [[*kept, _sweep_budget(key, side, value)] for value in values]

    # -- checks against the disk ----------------------------------------------------------------------

    def validate_paths(self) -> ModelSpec:
        """Check what the run will read, without loading a weight; returns the parent's ModelSpec.

        The parent directory holds a readable NemotronH config.json and safetensors weights; the tokenizer
        directory holds tokenizer files (when a source is text); every data source exists; the space file
        (if any) is a valid space whose variants fit the parent's blocks; the run directory and the token
        cache are outside the parent's directory; kept blocks exist. Raises ConfigError naming the key.
        """
        from puzzle import data as token_data
        from puzzle import nemotron_h
        from puzzle.nemotron_h.weights import weight_files

        parent = self.parent.path
        try:
            spec = nemotron_h.spec_from_config(
                nemotron_h.read_config(parent), str(parent / nemotron_h.CONFIG_NAME)
            )
            weight_files(parent)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error), "parent.path") from None
        try:
            sources = token_data.resolve_sources(self.data.sources)
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
        resolved_parent = parent.resolve()
        for key, path in (("run_dir", self.run_dir), ("data.cache_dir", self.data.cache_dir)):
            if path is None:
                continue
            resolved = path.resolve()
            if resolved == resolved_parent or resolved_parent in resolved.parents:
                raise ConfigError(
                    f"{path} is inside the parent checkpoint {parent}, which is never written to", key
                )
            if path.exists() and not path.is_dir():
                raise ConfigError(f"{path} exists and is not a directory", key)
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
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Plain data: `load_config_data(to_dict())` equals this config."""
        return to_dict(self)


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
        raise ConfigError(error.message, error.key, path, line_of(error.key, lines)) from None
    return config


def dump_config(config: RunConfig) -> str:
    """The config as YAML (every field, defaults included): what `load_config` reads back equal."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)
