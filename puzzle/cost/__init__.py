"""Costs of blocks and models from their specs: parameters, bytes, state, FLOPs, roofline or measured latency.

Per-kind rules live in one table keyed by spec type, `puzzle.cost.kinds.BLOCK_COSTS`.
"""

from puzzle._lazy import lazy_attributes as _lazy_attributes

# Named on first use: `puzzle.cost.limits` (the budget syntax a library search parses) must not pull in the
# cost model and the spec types.
_LAZY = {
    "BLOCK_COSTS": "puzzle.cost.kinds",
    "BlockCost": "puzzle.cost.kinds",
    "BlockLatency": "puzzle.cost.roofline",
    "HardwareProfile": "puzzle.cost.hardware",
    "QuantRecipe": "puzzle.cost.analytic",
    "RooflineLatency": "puzzle.cost.roofline",
    "Scenario": "puzzle.cost.roofline",
    "SpeedPoint": "puzzle.cost.roofline",
    "block_active_params": "puzzle.cost.analytic",
    "block_cost": "puzzle.cost.kinds",
    "block_latency": "puzzle.cost.roofline",
    "block_params": "puzzle.cost.analytic",
    "block_weight_bytes": "puzzle.cost.analytic",
    "get_hardware": "puzzle.cost.hardware",
    "get_recipe": "puzzle.cost.analytic",
    "kv_bytes_per_token": "puzzle.cost.analytic",
    "kv_cache_bytes": "puzzle.cost.analytic",
    "max_batch_at_speed": "puzzle.cost.roofline",
    "max_concurrent_requests": "puzzle.cost.roofline",
    "model_active_params": "puzzle.cost.analytic",
    "model_params": "puzzle.cost.analytic",
    "model_performance": "puzzle.cost.roofline",
    "model_throughput": "puzzle.cost.roofline",
    "model_weight_bytes": "puzzle.cost.analytic",
    "state_bytes_per_request": "puzzle.cost.analytic",
    "state_bytes_per_sequence": "puzzle.cost.analytic",
    "time_to_first_token": "puzzle.cost.roofline",
}

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)  # and submodules, e.g. `measure`

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
    "kv_cache_bytes",
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
