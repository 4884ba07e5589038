"""Costs of blocks and models from their specs: parameters, bytes, state, FLOPs, roofline or measured latency.

Per-kind rules live in one table keyed by spec type, `puzzle.cost.kinds.BLOCK_COSTS`.
"""

from puzzle._lazy import lazy_attributes as _lazy_attributes
from puzzle.cost.analytic import (
    QuantRecipe,
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
from puzzle.cost.hardware import HardwareProfile, get_hardware
from puzzle.cost.kinds import BLOCK_COSTS, BlockCost, block_cost
from puzzle.cost.roofline import (
    BlockLatency,
    RooflineLatency,
    Scenario,
    SpeedPoint,
    block_latency,
    max_batch_at_speed,
    max_concurrent_requests,
    model_performance,
    model_throughput,
    time_to_first_token,
)

__getattr__, __dir__ = _lazy_attributes(__name__)  # submodules not imported above, e.g. `measure`

__all__ = [
    "BLOCK_COSTS",
    "BlockCost",
    "BlockLatency",
    "HardwareProfile",
    "QuantRecipe",
    "RooflineLatency",
    "Scenario",
    "SpeedPoint",
    "block_active_params",
    "block_cost",
    "block_latency",
    "block_params",
    "block_weight_bytes",
    "get_hardware",
    "get_recipe",
    "kv_bytes_per_token",
    "max_batch_at_speed",
    "max_concurrent_requests",
    "model_active_params",
    "model_params",
    "model_performance",
    "model_throughput",
    "model_weight_bytes",
    "state_bytes_per_request",
    "state_bytes_per_sequence",
    "time_to_first_token",
]
