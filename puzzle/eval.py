"""Task accuracy through lm-evaluation-harness: our models and checkpoints handed to lm-eval's own HF model class.

lm-eval (the `eval` extra: `pip install 'puzzle-nas[eval]'`) does the tasks, the requests, the batching
and the metrics; this module only adapts. A transformers model (the load of an export or a checkpoint
whose config.json transformers reads) goes to lm-eval's `HFLM` as it is; a `HybridLM` (any child,
`nemotron_h_puzzle` checkpoints included) goes through `EvalAdapter`, which gives it the few
transformers attributes HFLM reads. The local tasks shipped in `puzzle/eval_tasks` are always
registered, so `evaluate(..., tasks=["puzzle_next_line"])` works offline.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from puzzle import dist
from puzzle.model import HybridLM

LOCAL_TASKS = Path(__file__).parent / "eval_tasks"
# HFLM's own fallback when a config names no context length; a HybridLM has no positional limit.
DEFAULT_MAX_LENGTH = 2048


# `puzzle demo --quiet` and `puzzle run --quiet` set it to "0" (puzzle.progress): lm-eval's bars and info
# lines go too (`quiet_lm_eval`).
PROGRESS_ENV = "PUZZLE_PROGRESS"


class EvalError(ValueError):
    """An evaluation that cannot start: lm-eval missing, a task unknown, a target that is no model."""


class UnknownTaskError(EvalError):
    """A task name that neither lm-eval's registry nor the include paths define."""

    def __init__(self, name: str, matches: list[str]) -> None:
        self.name = name
        self.matches = matches
        hint = f"; close matches: {', '.join(matches)}" if matches else "; no close match"
        super().__init__(f"unknown task {name!r}{hint} (`lm-eval ls tasks` lists lm-eval's)")


class _Output:
    """What HFLM reads of a forward's result: `.logits`."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class EvalAdapter(nn.Module):
    """A HybridLM dressed as the transformers causal LM that lm-eval's HFLM expects of a model instance.

    HFLM calls `model(input_ids).logits`, reads `model.config` (model type, context length) and
    `model.device`, and calls `model.eval()` and `model.tie_weights()`. Requests are padded on the right:
    a causal model's logits at real positions do not depend on the padding after them, so no attention
    mask is needed.
    """

    def __init__(self, model: HybridLM, max_length: int | None = None) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.model = model
        source = model.source_config or {}
        length = max_length or source.get("max_position_embeddings") or DEFAULT_MAX_LENGTH
        self.config = PretrainedConfig(max_position_embeddings=int(length), vocab_size=model.spec.vocab_size)

    @property
    def device(self) -> torch.device:
        """The device of the model's embeddings, where HFLM puts each batch of token ids."""
        return self.model.embeddings.weight.device

    def tie_weights(self) -> None:
        """Nothing to do: HybridLM ties lm_head to the embeddings at construction when its spec says so."""

    def forward(self, input_ids: torch.Tensor, **_: Any) -> _Output:
        """input_ids [b, t] -> an object whose `.logits` are [b, t, V] (fp32, as HybridLM returns them)."""
        return _Output(self.model(input_ids).logits)


class HubDataError(EvalError):
    """A task whose data lies on the Hugging Face hub, run where the hub cannot be reached (or offline)."""

    def __init__(self, tasks: dict[str, str], error: BaseException) -> None:
        self.tasks = tasks
        named = ", ".join(f"{t} (dataset {d})" for t, d in tasks.items()) or "the tasks asked for"
        reason = " ".join(str(error).split()) or type(error).__name__
        super().__init__(
            f"the data of {named} needs the Hugging Face hub, which cannot be reached here: {reason}; "
            "offline, run the local tasks (puzzle_next_line) or --include-path tasks with local data files"
        )


def hub_datasets(tasks: list[str], manager: Any) -> dict[str, str]:
    """{task: its hub dataset_path} of the named tasks (and the tasks of named groups and tags) whose
    config reads a dataset from the hub rather than a local file or a `custom_dataset` loader."""
    found: dict[str, str] = {}
    index = manager.task_index
    pending, seen = list(tasks), set()
    while pending:
        name = pending.pop(0)
        entry = index.get(name)
        if entry is None or name in seen:
            continue
        seen.add(name)
        cfg = entry.cfg if isinstance(entry.cfg, dict) else {}
        path = cfg.get("dataset_path")
        local = cfg.get("custom_dataset") or path in {"json", "csv", "parquet", "text", "arrow"}
        if isinstance(path, str) and not local and not Path(path).exists():
            found[name] = path
        children = cfg.get("task")
        if isinstance(children, list):  # a group's YAML lists its tasks
            pending += [c for c in children if isinstance(c, str)]
        if getattr(entry.kind, "name", "") == "TAG":  # a tag names the tasks that carry it
            pending += [n for n, e in index.items() if name in (getattr(e, "tags", None) or ())]
    return found


def _hub_error(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) is datasets / huggingface_hub failing to reach the hub."""
    while error is not None:
        if isinstance(
            error, ConnectionError
        ):  # datasets' "Couldn't reach ... on the Hub", OfflineModeIsEnabled
            return True
        if type(error).__name__ in {
            "DatasetNotFoundError",
            "LocalEntryNotFoundError",
            "OfflineModeIsEnabled",
        }:
            return True
        error = error.__cause__ or error.__context__
    return False


def _require_lm_eval() -> Any:
    """lm_eval, or an EvalError saying which extra installs it (its HF model class also needs accelerate)."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (imports accelerate)
    except ImportError as error:
        raise EvalError(
            f"task evaluation needs lm-evaluation-harness: pip install 'puzzle-nas[eval]' ({error})"
        ) from error
    return lm_eval


def task_manager(include_path: str | Path | list[str | Path] | None = None) -> Any:
    """lm-eval's TaskManager over its registry, our local tasks and `include_path` (a folder or several)."""
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [] if include_path is None else include_path
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return TaskManager(include_path=[str(LOCAL_TASKS), *(str(p) for p in paths)])


def check_tasks(tasks: list[str], manager: Any) -> None:
    """Raise UnknownTaskError for the first name the manager knows neither as a task, a group nor a tag."""
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            raise UnknownTaskError(name, difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6))


def evaluate(
    model: nn.Module,
    tokenizer: Any,
    tasks: list[str] | str,
    *,
    limit: int | float | None = None,
    batch_size: int = 1,
    include_path: str | Path | list[str | Path] | None = None,
    device: str | torch.device | None = None,
    manager: Any = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """Run lm-eval's `simple_evaluate` on `model` for `tasks`; returns lm-eval's results dict.

    `model`: a HybridLM (wrapped in EvalAdapter) or a transformers causal LM; `tokenizer` a transformers
    tokenizer. `tasks`: names (or one comma-separated string) from lm-eval's registry, our local tasks
    (`puzzle/eval_tasks`) or the YAMLs under `include_path`. `limit`: at most that many documents per task
    (a float < 1: that share). `device`: where to move the model first (default: where it is).
    `manager`: a `task_manager(include_path)` already built (indexing lm-eval's tasks takes seconds).
    `log_samples`: keep lm-eval's per-document outputs (results["samples"][task]: each its doc_id and
    metrics), for comparisons item by item (benchmarks/paired_eval.py).
    Raises UnknownTaskError (naming the task and close matches) before any model work, HubDataError when
    a task's data must come from a hub that cannot be reached.
    """
    lm_eval = _require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    names = [t for t in names if t]
    if not names:
        raise EvalError("no task given: name at least one (e.g. puzzle_next_line)")
    manager = task_manager(include_path) if manager is None else manager
    check_tasks(names, manager)
    if device is not None:
        model = model.to(device)
    wrapped = EvalAdapter(model) if isinstance(model, HybridLM) else model
    try:
        with quiet_lm_eval(_quiet()):
            lm = HFLM(pretrained=wrapped, tokenizer=tokenizer, batch_size=batch_size, backend="causal")
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=names,
                limit=limit,
                task_manager=manager,
                log_samples=log_samples,
                # Offline and quick: the bootstrap only serves metrics without a closed-form stderr.
                bootstrap_iters=1000,
            )
    except Exception as error:
        if _hub_error(error):
            raise HubDataError(hub_datasets(names, manager), error) from error
        raise
    # Every rank ran every request (HFLM given a model instance is one process to lm-eval; a sharded model's
    # forwards are collectives in step), but lm-eval returns the results on local rank 0 alone: rank 0's go
    # to all. As plain JSON data (what the run writes): the task configs' callables do not pickle.
    plain = None if results is None else json.loads(json.dumps(results, default=str))
    return dist.broadcast_object(plain) if dist.world_size() > 1 else plain


class _SilentTqdm(tqdm):
    """tqdm with every bar disabled, whatever `disable` its caller passes (lm-eval passes False on rank 0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _quiet() -> bool:
    """Whether this process was asked for no progress bars (PROGRESS_ENV is "0")."""
    return os.environ.get(PROGRESS_ENV, "").strip() == "0"


@contextlib.contextmanager
def quiet_lm_eval(quiet: bool = True) -> Iterator[None]:
    """Within it (when `quiet`), lm-eval shows no progress bar and logs errors only; as it was afterwards.

    lm-eval draws its bars (building requests, running them) with tqdm whatever stderr is, and its
    loggers ("lm_eval.*") say INFO lines for every task and the same warnings for every model (a local
    task's custom loader, a model passed as an instance): under --quiet those are noise, repeated five
    times a demo. Its modules import tqdm's class by name, so each lm_eval module's `tqdm` becomes a
    subclass whose bars are disabled; `tqdm.tqdm` itself is swapped too for the imports made inside
    functions (its bootstrap). Errors still reach stderr.
    """
    if not quiet:
        yield
        return
    import tqdm as tqdm_module

    swapped = [(tqdm_module, tqdm_module.tqdm)]
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] == "lm_eval" and getattr(module, "tqdm", None) is tqdm_module.tqdm:
            swapped.append((module, module.tqdm))
    logger = logging.getLogger("lm_eval")
    level = logger.level
    for module, _ in swapped:
        module.tqdm = _SilentTqdm
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        for module, original in swapped:
            module.tqdm = original


def metric_value(results: dict[str, Any], task: str, metric: str) -> tuple[float, bool]:
    """(value, higher_is_better) of `task`'s `metric` in a results dict: "acc" reads "acc,none" (or the one
    filter the task has); "exact_match,strict-match" names its filter. EvalError naming the task's
    metrics when it has no such one."""
    metrics = results.get("results", {}).get(task)
    if metrics is None:
        raise EvalError(f"the results hold no task {task!r} (tasks: {sorted(results.get('results', {}))})")
    name, _, _ = metric.partition(",")
    keys = [metric] if "," in metric else [k for k in metrics if k.partition(",")[0] == metric]
    keys = [k for k in keys if k in metrics and not k.partition(",")[0].endswith("_stderr")]
    if len(keys) != 1:
        found = sorted({k for k in metrics if "," in k and "_stderr" not in k})
        raise EvalError(
            f"task {task!r} has {'several' if keys else 'no'} metric {metric!r} "
            f"(it has: {', '.join(found)}): name one as METRIC or METRIC,FILTER"
        )
    higher = results.get("higher_is_better", {}).get(task, {}).get(name, True)
    return float(metrics[keys[0]]), bool(True if higher is None else higher)


def task_files(folder: Path) -> dict[str, str]:
    """{file: sha256} of the task YAMLs and data files under `folder`: what a local task reads."""
    from puzzle.artifacts import fingerprint_file

    return {
        str(path.relative_to(folder)): fingerprint_file(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in {".yaml", ".yml", ".jsonl", ".json", ".py", ".csv", ".txt"}
    }


def load_target(path: str | Path, dtype: str | torch.dtype = "float32") -> tuple[nn.Module, Any]:
    """The model and tokenizer of a checkpoint or export directory (config.json, safetensors, tokenizer files).

    A `nemotron_h` checkpoint loads as transformers' NemotronHForCausalLM, the class every user of the
    export runs; any other (`nemotron_h_puzzle`: children transformers cannot hold) as a HybridLM.
    """
    from puzzle.data import load_tokenizer

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EvalError(f"{path} is not a checkpoint: no config.json there")
    tokenizer = load_tokenizer(path)
    model_type = json.loads(config_file.read_text()).get("model_type")
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if model_type == "nemotron_h":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, local_files_only=True, trust_remote_code=False
        )
        return model.eval(), tokenizer
    from puzzle.nemotron_h import load

    return load(path, dtype=torch_dtype), tokenizer


def run_targets(run_dir: str | Path) -> dict[str, Path] | None:
    """{name: checkpoint} of a run directory's parent ("parent", from its saved config's parent.path) and
    every exported child (exports/NAME/, and round-R/exports/NAME/ as "round-R/NAME"), in that order; None
    when `run_dir` is no run directory (it holds neither run.json nor a saved run config)."""
    import yaml

    from puzzle.layout import EXPORTS_DIR, RunLayout

    layout = RunLayout(Path(run_dir))
    config_file = layout.resolved_config
    if not layout.manifest.is_file() and not config_file.is_file():
        return None
    targets: dict[str, Path] = {}
    if config_file.is_file():
        try:
            config = yaml.safe_load(config_file.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise EvalError(f"{config_file}: cannot read the run's config ({error})") from None
        parent = (config.get("parent") or {}).get("path") if isinstance(config, dict) else None
        if parent:
            targets["parent"] = (config_file.parent / parent).resolve()
    rounds = [(layout.root, "")] + [
        (folder, f"{folder.name}/") for folder in sorted(layout.root.glob("round-*")) if folder.is_dir()
    ]
    for root, prefix in rounds:
        for config in sorted((root / EXPORTS_DIR).glob("*/config.json")):
            targets[f"{prefix}{config.parent.name}"] = config.parent
    if not targets:
        raise EvalError(
            f"run directory {layout.root}: found no parent in its config and no {EXPORTS_DIR}/NAME/"
        )
    return targets


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric of a results dict: task, metric, value, stderr (None when lm-eval gave none)."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, flt = key.partition(",")  # "acc,none"; alias and sample_len have no filter
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{flt}")
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "value": float(value),
                    "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                }
            )
    return rows


def request_tokens(
    tasks: list[str],
    tokenizer: Any,
    *,
    limit: int | None = None,
    include_path: str | Path | list[str | Path] | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> dict[str, list[int] | str]:
    """{task: the token count of each of its requests} as lm-eval builds them (its documents up to `limit`;
    a multiple-choice document is one request per choice), or {task: why they cannot be counted here}
    (its data needs the hub). A loglikelihood request is one forward of context + continuation; a
    generation, of the context and its max_gen_toks (default 256); each cut to `max_length` as HFLM cuts."""
    with quiet_lm_eval(_quiet()):
        return _request_tokens(tasks, tokenizer, limit, include_path, max_length)


def _request_tokens(
    tasks: list[str],
    tokenizer: Any,
    limit: int | None,
    include_path: str | Path | list[str | Path] | None,
    max_length: int,
) -> dict[str, list[int] | str]:
    """request_tokens' work, under its quiet setting."""
    manager = task_manager(include_path)
    check_tasks(tasks, manager)
    counts: dict[str, list[int] | str] = {}
    for name in tasks:
        try:
            loaded = manager.load_task_or_group([name])
        except Exception as error:  # a hub dataset offline, most often: the plan says so and goes on
            counts[name] = " ".join(str(error).split())[:200] or type(error).__name__
            continue
        pending = list(loaded.values())
        while pending:
            task = pending.pop()
            if isinstance(task, dict):  # a group: its tasks
                pending += list(task.values())
                continue
            task.build_all_requests(limit=limit, rank=0, world_size=1)
            lengths = counts.setdefault(task.config.task, [])
            for instance in task.instances:
                context, second = instance.arguments[0], instance.arguments[1]
                tokens = len(tokenizer.encode(context, add_special_tokens=False))
                if isinstance(second, str):
                    tokens += len(tokenizer.encode(second, add_special_tokens=False))
                else:
                    tokens += int((second or {}).get("max_gen_toks", 256))
                lengths.append(min(tokens, max_length))
    return counts
