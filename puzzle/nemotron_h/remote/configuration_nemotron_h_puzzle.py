"""Configuration of NemotronH-Puzzle models: Nemotron-H stacks whose blocks each have their own shape.

Written next to the checkpoints that the `puzzle` library exports as `nemotron_h_puzzle` (self-contained:
torch and transformers only). config.json holds the global NemotronH fields, the kind of every block
(`layers_block_type`, else `hybrid_override_pattern`, else each entry's `block_type`) and `block_configs`,
one dict per block whose fields override the global ones (a missing or null field inherits the global).

Block kinds: mamba, attention, moe, mlp, and two kinds of puzzle's own: `linear` (one hidden x hidden matrix)
and `noop` (a removed block). `moe_intermediate_size` may be a list with one width per routed expert.
An attention entry's `sliding_window` N makes that block attend to its last N tokens only (its own included,
as transformers and vLLM count it); absent or null: full attention.
`mtp_block_configs` describes the blocks of the MTP module the same way (they follow the main blocks).

Serving engines read this class too: vLLM loads nemotron_h_puzzle configs with trust_remote_code and builds
each layer from `get_nemotron_h_config_for_layer(i)` (vllm/model_executor/models/nemotron_h.py), the MTP
module from `mtp_hybrid_override_pattern`, layers num_hidden_layers + j and `mtp_n_routed_experts`
(vllm/model_executor/models/nemotron_h_mtp.py).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

# Every name a block kind goes by: layers_block_type (old and new spellings), block_type, pattern character.
KIND_NAMES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "M": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "moe": "moe",
    "E": "moe",
    "mlp": "mlp",
    "-": "mlp",
    "linear": "linear",
    "L": "linear",
    "noop": "noop",
    "N": "noop",
}

# Old field names of NemotronH configs -> current ones (the old one wins if both are given).
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "num_local_experts": "n_routed_experts",
    "layer_types": "layers_block_type",
}

# What a field absent from config.json means: transformers' NemotronHConfig defaults (+ ours).
BLOCK_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_head_dim": None,
    "attention_bias": False,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "time_step_min": 0.001,
    "use_conv_bias": True,
    "chunk_size": 128,
    "use_bias": False,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "mamba_dt_clamp_max": None,  # puzzle: an upper clamp of dt after softplus (None: none)
    "linear_bias": False,  # puzzle: a bias on the `linear` block's matrix
    "sliding_window": None,  # an attention block's window: its last N tokens, its own included (None: all)
}


# Kind -> the hybrid_override_pattern character (vLLM reads the MTP module's kinds as such a pattern).
_PATTERN_CHARS = {"mamba": "M", "attention": "*", "moe": "E", "mlp": "-", "linear": "L", "noop": "N"}


def _kind(name: Any, where: str) -> str:
    if name not in KIND_NAMES:
        raise ValueError(f"config.json {where}: unknown block type {name!r}; known: {sorted(KIND_NAMES)}")
    return KIND_NAMES[name]


def _layer_kinds(layers_block_type: Any, pattern: Any, block_configs: Any) -> list[str]:
    """The block kinds from layers_block_type, else hybrid_override_pattern, else block_configs' block_type."""
    if layers_block_type is not None:
        return [_kind(name, f"layers_block_type[{i}]") for i, name in enumerate(layers_block_type)]
    if pattern is not None:
        return [_kind(char, f"hybrid_override_pattern[{i}]") for i, char in enumerate(pattern)]
    if block_configs is not None:
        return [
            _kind(entry.get("block_type"), f"block_configs[{i}]") for i, entry in enumerate(block_configs)
        ]
    return []  # an empty config, as transformers builds one to compare defaults


class NemotronHPuzzleConfig(PretrainedConfig):
    """A NemotronH-Puzzle config: global fields plus per-block overrides (`block_fields(i)` merges them)."""

    model_type = "nemotron_h_puzzle"

    def __init__(
        self,
        vocab_size: int = 131072,
        hidden_size: int = 4096,
        layers_block_type: list[str] | None = None,
        block_configs: list[dict[str, Any]] | None = None,
        num_hidden_layers: int | None = None,
        layer_norm_epsilon: float = 1e-5,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        for old, new in ALIASES.items():
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
        layers_block_type = kwargs.pop("layers_block_type", layers_block_type)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.layers_block_type = layers_block_type
        self.block_configs = block_configs
        self.layer_norm_epsilon = layer_norm_epsilon
        kinds = _layer_kinds(layers_block_type, kwargs.get("hybrid_override_pattern"), block_configs)
        if block_configs is not None:
            if len(block_configs) != len(kinds):
                raise ValueError(
                    f"config.json: block_configs has {len(block_configs)} entries, the layer layout {len(kinds)}"
                )
            for i, (entry, kind) in enumerate(zip(block_configs, kinds)):
                if "block_type" in entry and _kind(entry["block_type"], f"block_configs[{i}]") != kind:
                    raise ValueError(
                        f"config.json: block {i} is {kind!r} in the layer layout, block_configs says "
                        f"{entry['block_type']!r}"
                    )
        self.num_hidden_layers = len(kinds) if kinds else (num_hidden_layers or 0)
        if kwargs.get("hybrid_override_pattern") is None and kinds:
            # vLLM picks each layer's class from this pattern; configs that give only layers_block_type or
            # block_configs (NVIDIA's Puzzle schema) get it from the kinds.
            kwargs["hybrid_override_pattern"] = "".join(_PATTERN_CHARS[kind] for kind in kinds)
        mtp_entries = kwargs.get("mtp_block_configs") or []
        if kwargs.get("mtp_hybrid_override_pattern") is None and (
            mtp_entries or kwargs.get("mtp_layers_block_type")
        ):
            # vLLM's NemotronH MTP module builds its layers from this pattern.
            names = kwargs.get("mtp_layers_block_type") or [entry.get("block_type") for entry in mtp_entries]
            kwargs["mtp_hybrid_override_pattern"] = "".join(
                _PATTERN_CHARS[_kind(name, f"mtp_layers_block_type[{i}]")] for i, name in enumerate(names)
            )
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def block_kinds(self) -> list[str]:
        """One kind per block: "mamba", "attention", "moe", "mlp", "linear" or "noop"."""
        pattern = getattr(self, "hybrid_override_pattern", None)
        return _layer_kinds(self.layers_block_type, pattern, self.block_configs)

    def _entries(self) -> list[dict[str, Any]]:
        """The block_configs entries of the main blocks, then those of the MTP blocks (mtp_block_configs)."""
        main = self.block_configs or [{}] * self.num_hidden_layers
        return [*main, *(getattr(self, "mtp_block_configs", None) or [])]

    def block_fields(self, index: int) -> dict[str, Any]:
        """The fields of block `index`: defaults < the global fields < its block_configs entry (non-null values).

        Indices from num_hidden_layers on are the MTP module's blocks (mtp_block_configs), as vLLM numbers them.
        """
        fields = {key: getattr(self, key, default) for key, default in BLOCK_DEFAULTS.items()}
        fields["hidden_size"] = self.hidden_size
        fields["layer_norm_epsilon"] = self.layer_norm_epsilon
        entries = self._entries()
        if not 0 <= index < len(entries):
            raise IndexError(
                f"config.json: block {index} does not exist; the model has {len(entries)} blocks"
            )
        entry = dict(entries[index])
        for old, new in ALIASES.items():
            if old in entry:
                entry[new] = entry.pop(old)
        fields.update(
            {key: value for key, value in entry.items() if key != "block_type" and value is not None}
        )
        return fields

    def get_nemotron_h_config_for_layer(self, index: int) -> NemotronHPuzzleConfig:
        """A copy of this config whose fields are block `index`'s (block_configs, then mtp_block_configs).

        The name and meaning are vLLM's: its NemotronH decoder layers call this, when the config class has
        it, and build the layer from the returned config's global fields.
        """
        layer = copy.deepcopy(self)
        for key, value in self.block_fields(index).items():
            setattr(layer, key, value)
        return layer

    @property
    def mtp_n_routed_experts(self) -> int | None:
        """The routed-expert count of the MTP module's MoE blocks (the largest; None without one): vLLM's
        NemotronH MTP loader maps this many experts for nemotron_h_puzzle."""
        counts = [
            self.block_fields(self.num_hidden_layers + j)["n_routed_experts"]
            for j, entry in enumerate(getattr(self, "mtp_block_configs", None) or [])
            if _kind(entry.get("block_type"), f"mtp_block_configs[{j}]") == "moe"
        ]
        return max(counts, default=None)
