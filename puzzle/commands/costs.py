"""`puzzle costs TARGET`: parameters, weight memory, per-request state and concurrency of a model.

TARGET is a preset name (`puzzle costs nemotron3-super`), a checkpoint directory, a config.json
file (nemotron_h, or nemotron_h_puzzle with per-block `block_configs`), or a puzzle model spec JSON
(`ModelSpec.to_json`, e.g. an assembled child's `child.spec`, per-block weight formats included: a block in
fp8 or nvfp4 has its matmul weights counted in that format, whatever --recipe says for them). A quantized
export of puzzle's (compressed-tensors `quantization_config`) is read as `puzzle.load` reads it: each block
in the format its weights are stored in, from the weight files' headers beside config.json.

With `--user-speed TOKENS_PER_S`, also per scenario (`--scenario`, default the seed's two workloads,
8k in / 64k out and 50k in / 2k out): the largest batch whose predicted per-user decode speed stays at or
above that speed and fits in memory, and the server's output tokens/s at that batch (roofline, prefill
included), e.g. `puzzle costs nemotron3-super --hardware 8xb200 --recipe nvfp4 --user-speed 500`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from puzzle.commands import fraction, positive_int
from puzzle.cost.analytic import (
    DTYPE_BYTES,
    RECIPES,
    block_active_params,
    block_params,
    block_weight_bytes,
    get_recipe,
    kv_bytes_per_token,
    model_active_params,
    model_params,
    model_weight_bytes,
    state_bytes_per_request,
    state_bytes_per_sequence,
)
from puzzle.cost.hardware import DEFAULT_HARDWARE, DEFAULT_MEMORY_FRACTION, get_hardware, hardware_names
from puzzle.cost.roofline import (
    COMPUTE_DTYPES,
    Scenario,
    SpeedPoint,
    max_batch_at_speed,
    max_concurrent_requests,
)
from puzzle.presets import PRESETS, get_preset
from puzzle.spec import ModelSpec, SpecError, weight_formats

STATE_DTYPES = ("fp32", "bf16", "fp16", "fp8")
# The seed's published workloads (Puzzle-75B against Super on 8xB200 at a fixed per-user speed); k = 1024.
DEFAULT_SPEED_SCENARIOS = ("8k-64k:prompt=8192,generated=65536", "50k-2k:prompt=51200,generated=2048")
# The matmul precision a weight recipe runs at when --compute-dtype is not given (W4A4 nvfp4, W8A8 fp8).
RECIPE_COMPUTE = {"fp8": "fp8", "nvfp4": "nvfp4", "nvfp4-experts": "fp8", "fp32": "fp32"}
DTYPE_UNITS = "bytes per value: " + ", ".join(f"{dtype} {DTYPE_BYTES[dtype]:g}" for dtype in STATE_DTYPES)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `costs` sub-command to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "costs",
        help="parameters, weight memory, per-request state and concurrency of a model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "target",
        help=f"a preset ({', '.join(sorted(PRESETS))}), a checkpoint dir, a config.json or a puzzle model "
        "spec JSON (per-block weight formats included)",
    )
    parser.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"the device whose memory holds weights and requests: one of {hardware_names()}, or NxNAME "
        "for N GPUs serving one copy tensor/expert parallel, e.g. 8xb200 (default %(default)s)",
    )
    parser.add_argument(
        "--context",
        type=positive_int,
        default=1_000_000,
        metavar="TOKENS",
        help="tokens of context per request, e.g. 128000, 128k, 1e6 (default %(default)s tokens)",
    )
    parser.add_argument(
        "--recipe",
        default="bf16",
        help=f"weight storage format per tensor role: one of {sorted(RECIPES)} (default %(default)s)",
    )
    parser.add_argument(
        "--kv-dtype",
        default=None,
        choices=STATE_DTYPES,
        help=f"KV cache storage, {DTYPE_UNITS} (default %(default)s: the checkpoint's own, fp8 for an export "
        "whose config.json has a kv_cache_scheme, else bf16)",
    )
    parser.add_argument(
        "--ssm-dtype",
        default="fp32",
        choices=STATE_DTYPES,
        help=f"Mamba SSM state storage, {DTYPE_UNITS} (default %(default)s)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=fraction,
        default=DEFAULT_MEMORY_FRACTION,
        metavar="FRACTION",
        help="share of the device memory usable for weights and requests, in (0, 1] "
        "(default %(default)s, vLLM's gpu_memory_utilization)",
    )
    parser.add_argument(
        "--user-speed",
        type=positive_float,
        metavar="TOKENS_PER_S",
        help="also print, per scenario, the largest batch whose per-user decode speed stays at or above "
        "this and the server throughput at that batch (default %(default)s: not printed)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        default=None,
        metavar="NAME:prompt=P,generated=G",
        help="a workload for --user-speed (repeatable; also kv_dtype=, compute_dtype=, ...; default "
        "%(default)s: the seed's " + " and ".join(DEFAULT_SPEED_SCENARIOS) + ")",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=COMPUTE_DTYPES,
        help="matmul precision for --user-speed (default %(default)s: the recipe's format, nvfp4-experts fp8, "
        "bf16 for bf16)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(func=run)


def load_target(target: str) -> tuple[ModelSpec, str]:
    """(ModelSpec, what it is) for a preset name, a checkpoint directory or a config.json path."""
    from puzzle import nemotron_h  # late: keeps `puzzle costs PRESET` free of checkpoint machinery

    path = Path(target)
    if path.is_dir():
        return _checkpoint_spec(path, nemotron_h.read_config(path), str(path / nemotron_h.CONFIG_NAME)), (
            f"checkpoint {path}"
        )
    if path.is_file():
        spec = _model_spec_file(path)
        if spec is not None:
            return spec, f"model spec {path}"
        config = nemotron_h.read_config_file(path)
        return _checkpoint_spec(path.parent, config, str(path)), f"config {path}"
    if path.exists():  # a device, a fifo...
        raise SpecError(f"{target} is neither a config.json file nor a checkpoint directory")
    if path.suffix == ".json" or "/" in target:
        raise SpecError(f"{target} does not exist")
    return get_preset(target), f"preset {target}"


def target_kv_dtype(target: str) -> str:
    """The KV cache dtype `target` is served with: "fp8" for a checkpoint directory or config.json whose
    `quantization_config` has puzzle's fp8 `kv_cache_scheme` (`puzzle.nemotron_h.kv_export`: an export of a
    KV-fp8 child, whose scales vLLM loads), else "bf16" (a preset, a spec JSON, any other checkpoint)."""
    from puzzle import nemotron_h

    path = Path(target)
    if path.is_dir():
        config, where = nemotron_h.read_config(path), str(path / nemotron_h.CONFIG_NAME)
    elif path.is_file() and _model_spec_file(path) is None:
        config, where = nemotron_h.read_config_file(path), str(path)
    else:
        return "bf16"
    if not config.get("quantization_config"):
        return "bf16"
    from puzzle.nemotron_h.kv_export import check_kv_cache_scheme  # late: torch, for a quantized config only

    return "fp8" if check_kv_cache_scheme(config, where) else "bf16"


def _checkpoint_spec(directory: Path, config: dict[str, Any], where: str) -> ModelSpec:
    """The spec of a checkpoint's `config` (read from `where`, its weights in `directory`). A quantized export
    of puzzle's (compressed-tensors) gets each block's stored weight format as `puzzle.load` reads it, from
    the weight files' headers, so its weights are counted in the formats they are served in."""
    from puzzle import nemotron_h

    if config.get("quantization_config"):
        from puzzle.nemotron_h import quantized  # late: torch, for a quantized checkpoint only

        if quantized.quant_method(config) == quantized.QUANT_METHOD:
            try:
                return nemotron_h.stored_spec(directory, config)
            except nemotron_h.CheckpointError as error:
                raise nemotron_h.CheckpointError(
                    f"{where} describes a quantized checkpoint, whose blocks' formats are read from its "
                    f"weight files beside it: {error}"
                ) from None
        # Another tool's quantization (e.g. ModelOpt): its architecture alone, weights counted per --recipe.
    return nemotron_h.spec_from_config(config, where)


def _model_spec_file(path: Path) -> ModelSpec | None:
    """The ModelSpec in `path` when it is a puzzle model spec JSON ("blocks", no "model_type"), else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # read_config_file says what is wrong with it
    if not isinstance(data, dict) or "model_type" in data or "blocks" not in data:
        return None
    try:
        return ModelSpec.from_dict(data)
    except SpecError as error:
        raise SpecError(f"{path}: not a valid puzzle model spec: {error}") from None


def compute_costs(
    spec: ModelSpec,
    hardware: str,
    context: int,
    recipe: str,
    kv_dtype: str,
    ssm_dtype: str = "fp32",
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
) -> dict[str, Any]:
    """Every figure `puzzle costs` prints, as a JSON-ready dict (bytes, parameters, counts: all integers).

    Byte counts are rounded up to whole bytes (nvfp4 packs two values per byte). `usable_memory_bytes` is
    memory_fraction x the device's memory; `weights_fit` says whether the weights alone fit in it (when
    not, max_concurrent_requests is 0 whatever the context).
    """
    profile = get_hardware(hardware)
    get_recipe(recipe)
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise SpecError(f"--context must be a positive number of tokens, found {context!r}")
    if not 0 < memory_fraction <= 1:
        raise SpecError(f"--memory-fraction must be in (0, 1], found {memory_fraction!r}")
    H = spec.hidden_size
    by_kind: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "blocks": 0,
            "params": 0,
            "active_params": 0,
            "weight_bytes": 0.0,  # rounded up once summed
            "state_bytes_per_request": 0,
        }
    )
    for block in spec.blocks:
        row = by_kind[block.kind]
        row["blocks"] += 1
        row["params"] += block_params(block, H)
        row["active_params"] += block_active_params(block, H)
        row["weight_bytes"] += block_weight_bytes(block, H, recipe)
        row["state_bytes_per_request"] += state_bytes_per_request(block, context, kv_dtype, ssm_dtype)
    weight_bytes = model_weight_bytes(spec, recipe)
    embedding_bytes = math.ceil(weight_bytes - sum(row["weight_bytes"] for row in by_kind.values()))
    for row in by_kind.values():
        row["weight_bytes"] = math.ceil(row["weight_bytes"])
    weight_bytes = math.ceil(weight_bytes)
    usable_bytes = math.floor(memory_fraction * profile.memory_bytes)
    embedding_params = model_params(spec) - sum(row["params"] for row in by_kind.values())
    by_kind["embeddings+lm_head+norm_f"] = {
        "blocks": 0,
        "params": embedding_params,
        "active_params": embedding_params,
        "weight_bytes": embedding_bytes,
        "state_bytes_per_request": 0,
    }
    try:
        concurrent: int | None = max_concurrent_requests(
            spec, profile, context, recipe, kv_dtype, memory_fraction, ssm_dtype
        )
    except SpecError:
        concurrent = None  # no per-request state: memory does not bound concurrency
    return {
        "pattern": spec.pattern,
        "num_blocks": spec.num_blocks,
        "hidden_size": H,
        "hardware": profile.name,
        "hardware_memory_bytes": profile.memory_bytes,
        "memory_fraction": memory_fraction,
        "usable_memory_bytes": usable_bytes,
        "context": context,
        "recipe": recipe,
        "kv_dtype": kv_dtype,
        "ssm_dtype": ssm_dtype,
        "total_params": model_params(spec),
        "active_params": model_active_params(spec),
        "weight_bytes": weight_bytes,
        "weights_fit": weight_bytes <= usable_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(spec, kv_dtype),
        "recurrent_state_bytes_per_request": state_bytes_per_sequence(spec, ssm_dtype),
        "state_bytes_per_request": state_bytes_per_request(spec, context, kv_dtype, ssm_dtype),
        "max_concurrent_requests": concurrent,
        "weight_formats": {str(i): fmt for i, fmt in weight_formats(spec).items()},  # blocks not in bf16
        "by_kind": dict(by_kind),
    }


def _bytes(value: float) -> str:
    """A byte count in decimal units: '69.544 GB', '18.7 kB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:,.3f} {unit}"
    return f"{value:,.0f} B"


def format_table(costs: dict[str, Any], title: str) -> str:
    """Markdown tables: one row per block kind, then the totals."""
    lines = [
        f"{title}: {costs['num_blocks']} blocks, hidden {costs['hidden_size']}",
        f"weights {costs['recipe']}, KV {costs['kv_dtype']}, SSM state {costs['ssm_dtype']}, "
        f"context {costs['context']:,} tokens, {costs['hardware']} x {costs['memory_fraction']:.0%} of "
        f"{costs['hardware_memory_bytes'] / 1e9:,.1f} GB",
        "",
        "| part | blocks | params | active params | weights | state / request |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, row in costs["by_kind"].items():
        lines.append(
            f"| {kind} | {row['blocks']} | {row['params']:,} | {row['active_params']:,} | "
            f"{_bytes(row['weight_bytes'])} | {_bytes(row['state_bytes_per_request'])} |"
        )
    lines += [
        "",
        "| total | value |",
        "|---|---:|",
        f"| parameters | {costs['total_params']:,} |",
        f"| active parameters | {costs['active_params']:,} |",
        f"| weight memory | {_bytes(costs['weight_bytes'])} |",
        f"| KV bytes / token | {costs['kv_bytes_per_token']:,} |",
        f"| recurrent state bytes / request | {costs['recurrent_state_bytes_per_request']:,} |",
        f"| state / request | {_bytes(costs['state_bytes_per_request'])} |",
        f"| max concurrent requests | {_concurrency(costs)} |",
    ]
    return "\n".join(lines)


def _concurrency(costs: dict[str, Any]) -> str:
    """The max-concurrent-requests cell, saying why when it is 0."""
    concurrent = costs["max_concurrent_requests"]
    if concurrent is None:
        return "unbounded (no per-request state)"
    if concurrent > 0:
        return f"{concurrent:,}"
    usable, weights = costs["usable_memory_bytes"], costs["weight_bytes"]
    if not costs["weights_fit"]:
        return f"0: the weights alone ({_bytes(weights)}) do not fit in the usable {_bytes(usable)}"
    return (
        f"0: one request ({_bytes(costs['state_bytes_per_request'])}) does not fit in the "
        f"{_bytes(usable - weights)} left beside the weights"
    )


def run(args: argparse.Namespace) -> int:
    """`puzzle costs`: print the table (or JSON) for args.target; exit code 2 with a message on bad input."""
    try:
        spec, title = load_target(args.target)
        if args.kv_dtype is None:  # the export's own cache (an fp8 one carries its scales), else bf16
            args.kv_dtype = target_kv_dtype(args.target)
        costs = compute_costs(
            spec,
            args.hardware,
            args.context,
            args.recipe,
            args.kv_dtype,
            args.ssm_dtype,
            args.memory_fraction,
        )
        if args.user_speed is None and (args.scenario or args.compute_dtype):
            # Only --user-speed reads them: silently ignoring a workload the user typed would hide a mistake.
            given = "--scenario" if args.scenario else "--compute-dtype"
            raise SpecError(f"{given} is only used with --user-speed TOKENS_PER_S; add it or drop {given}")
        if args.user_speed is not None:
            scenarios = speed_scenarios(args.scenario, args)
            costs["at_user_speed"] = [
                speed_row(point, scenario)
                for scenario in scenarios
                for point in [
                    max_batch_at_speed(spec, scenario, args.hardware, args.user_speed, args.memory_fraction)
                ]
            ]
    except (ValueError, OSError) as error:  # SpecError and nemotron_h.CheckpointError are ValueErrors
        print(f"puzzle costs: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"target": args.target, **costs}, indent=2))
    else:
        print(format_table(costs, title))
        if "at_user_speed" in costs:
            print("\n" + format_speed_table(costs["at_user_speed"], args.user_speed))
    return 0


def positive_float(text: str) -> float:
    """A number > 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, found {text!r}")
    return value


def speed_scenarios(texts: list[str] | None, args: argparse.Namespace) -> list[Scenario]:
    """The --scenario workloads (the defaults when none), in the command's recipe and state dtypes."""
    from puzzle.cost.serving import parse_scenario  # late: only a --scenario needs it

    defaults = {
        "batch_size": 1,  # the batch is what --user-speed searches
        "recipe": args.recipe,
        "kv_dtype": args.kv_dtype,
        "ssm_dtype": args.ssm_dtype,
        "compute_dtype": args.compute_dtype or RECIPE_COMPUTE.get(args.recipe, "bf16"),
    }
    scenarios = [parse_scenario(text, defaults) for text in texts or DEFAULT_SPEED_SCENARIOS]
    names = [scenario.name for scenario in scenarios]
    if len(set(names)) != len(names):
        raise SpecError(f"--scenario names must differ, found {names}")
    return scenarios


def speed_row(point: SpeedPoint, scenario: Scenario) -> dict[str, Any]:
    """One scenario's figures at the user speed, JSON-ready."""
    performance = point.performance
    return {
        "scenario": scenario.name,
        "prompt_tokens": scenario.prompt_tokens,
        "generated_tokens": scenario.generated_tokens,
        "compute_dtype": scenario.compute_dtype,
        "user_speed": point.user_speed,
        "batch": point.batch,
        "limited_by": point.limited_by,
        "max_concurrent_requests": point.max_concurrent,
        "per_user_tokens_per_s": performance.per_user_tokens_per_s if performance else None,
        "output_tokens_per_s": point.throughput,
        "prefill_s": performance.prefill_s if performance else None,
        "decode_step_s": performance.decode_step_s if performance else None,
    }


def format_speed_table(rows: list[dict[str, Any]], user_speed: float) -> str:
    """Markdown table of the figures at the user speed, one row per scenario."""
    lines = [
        f"at >= {user_speed:g} tokens/s per user (roofline; batch = largest meeting the speed and fitting memory)",
        "",
        "| scenario | in / out | batch | limited by | tokens/s per user | output tokens/s | prefill s |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        speed = row["per_user_tokens_per_s"]
        prefill = row["prefill_s"]
        lines.append(
            f"| {row['scenario']} | {row['prompt_tokens']:,} / {row['generated_tokens']:,} | {row['batch']:,} | "
            f"{row['limited_by']} | {'-' if speed is None else f'{speed:,.1f}'} | "
            f"{row['output_tokens_per_s']:,.0f} | {'-' if prefill is None else f'{prefill:,.3f}'} |"
        )
    return "\n".join(lines)
