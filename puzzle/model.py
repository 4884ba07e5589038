"""HybridLM: embeddings -> pre-norm residual blocks (one mixer each) -> final norm -> lm_head, with caches and generate().

The stack is a plain list of blocks built from a `ModelSpec`, so a heterogeneous child (pruned widths,
linear or removed blocks) needs no special case. State-dict keys are the NemotronH hub keys without
the `backbone.` prefix; `puzzle.nemotron_h` converts checkpoints in and out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from puzzle.blocks import build_block, formats
from puzzle.spec import BlockSpec, ModelSpec, NoOpSpec, SpecError


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 and cast back to the input dtype (as NemotronHRMSNorm).

    The weight multiplies the fp32 normalised activations before the cast, so a bf16 model rounds once.
    """

    def __init__(self, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., size] -> [..., size], same dtype as x."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Block(nn.Module):
    """One residual block: `x + mixer(norm(x))`. A no-op block has no norm (no parameters) and returns x.

    `mixer`: an already built mixer for `spec` (see `HybridLM(spec, mixers=...)`), else one is built.
    """

    def __init__(
        self, spec: BlockSpec, hidden_size: int, norm_eps: float, mixer: nn.Module | None = None
    ) -> None:
        super().__init__()
        # No parameter that forward never uses: DDP / FSDP would wait for its gradient.
        self.norm = None if isinstance(spec, NoOpSpec) else RMSNorm(hidden_size, norm_eps)
        self.mixer = build_block(spec, hidden_size, norm_eps) if mixer is None else mixer

    @property
    def spec(self) -> BlockSpec:
        """The mixer's spec: one source of truth, so swapping `block.mixer` changes the block's shape too."""
        return self.mixer.spec

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """x: [b, t, H] -> [b, t, H]; a cache is continued and left at the end of x."""
        if isinstance(self.spec, NoOpSpec):
            return x
        # The residual stays in x's dtype; the mixer sees the norm's dtype (as NemotronHBlock).
        return x + self.mixer(self.norm(x.to(self.norm.weight.dtype)), cache=cache)

    def step(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        """One-token decode: x [b, 1, H] -> [b, 1, H], updating `cache`."""
        if isinstance(self.spec, NoOpSpec):
            return x
        with formats.step_context(self.mixer):  # a direct step call skips the mixer's fake-quant hooks
            return x + self.mixer.step(self.norm(x.to(self.norm.weight.dtype)), cache)


@dataclass
class ModelCache:
    """Decoding state of a whole model: one cache per block (None for stateless blocks) and the tokens seen."""

    blocks: list[Any]
    position: int = 0


@dataclass
class ModelOutput:
    """`logits` [b, t, V] (fp32); `hidden_states`: (embeddings output, block 0 output, ...) when asked, else None;
    `loss`: the causal LM loss when `labels` were given (see `causal_lm_loss`), else None."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    cache: ModelCache | None = None
    loss: torch.Tensor | None = None


IGNORE_INDEX = -100  # label value excluded from the loss, as in transformers


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy as transformers' causal LMs compute it: position i predicts labels[:, i + 1],
    the mean over the labels that are not IGNORE_INDEX (-100), in fp32. logits [b, t, V], labels [b, t]."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels have shape {list(labels.shape)}, expected {list(logits.shape[:-1])} (the input_ids' shape)"
        )
    shifted = logits[:, :-1].float().flatten(0, 1)
    return nn.functional.cross_entropy(
        shifted, labels[:, 1:].flatten().to(shifted.device), ignore_index=IGNORE_INDEX
    )


def _check_mixer(index: int, mixer: nn.Module, expected: BlockSpec | None, hidden_size: int) -> None:
    """A mixer fits block `index`: it has a `.spec` (equal to `expected` when given) and the tensor shapes
    `build_block` gives that spec at this hidden size."""
    own = getattr(mixer, "spec", None)
    if own is None:
        raise TypeError(
            f"block {index}: a mixer needs a .spec (build it with puzzle.blocks.build_block), "
            f"got {type(mixer).__name__}"
        )
    if expected is not None and own != expected:
        raise SpecError(
            f"block {index}: the given mixer is a {own.short_name()}, the model spec has "
            f"{expected.short_name()} there ({own} != {expected})"
        )
    with torch.device("meta"):  # shapes only: nothing is allocated
        reference = build_block(own, hidden_size)
    shapes = {name: tuple(t.shape) for name, t in mixer.state_dict().items()}
    for name, tensor in reference.state_dict().items():
        if shapes.get(name) != tuple(tensor.shape):
            found = "missing" if name not in shapes else f"shape {list(shapes[name])}"
            raise SpecError(
                f"block {index}: mixer tensor {name!r} is {found}, expected {list(tensor.shape)} "
                f"for {own.short_name()} at hidden size {hidden_size}"
            )


class HybridLM(nn.Module):
    """A hybrid Mamba / attention / MoE / MLP language model built from a `ModelSpec`.

    `mixers`: optionally one entry per block, an already built mixer (e.g. a trained library variant,
    used as is, not copied: its device and dtype are the caller's) or None to build that block's mixer
    from the spec. A given mixer's `.spec` must equal the block's spec. Everything else (embeddings,
    norms, lm_head) is built from the spec, on the current device (`torch.device("meta")` included).

    Attributes besides the modules: `spec`; `extra_tensors` (name -> tensor or lazy safetensors
    reference: checkpoint tensors outside the backbone, e.g. MTP weights, written back on save);
    `source_config` and `source_path` (the checkpoint it was loaded from, if any).
    """

    def __init__(self, spec: ModelSpec, mixers: Sequence[nn.Module | None] | None = None) -> None:
        super().__init__()
        if mixers is None:
            mixers = [None] * spec.num_blocks
        listed = isinstance(mixers, (Sequence, nn.ModuleList))
        if not listed or len(mixers) != spec.num_blocks:
            found = f"{len(mixers)} entries" if listed else f"a {type(mixers).__name__}"
            raise SpecError(
                f"mixers: expected one entry (a mixer or None) per block ({spec.num_blocks}), found {found}"
            )
        for index, (block, mixer) in enumerate(zip(spec.blocks, mixers)):
            if mixer is not None:
                _check_mixer(index, mixer, block, spec.hidden_size)
        # Everything but the blocks; each block's shape lives in its mixer (see `spec`).
        self._model_fields = {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "norm_eps": spec.norm_eps,
            "tie_embeddings": spec.tie_embeddings,
        }
        self.embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            Block(block, spec.hidden_size, spec.norm_eps, mixer) for block, mixer in zip(spec.blocks, mixers)
        )
        self.norm_f = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embeddings.weight
        self.extra_tensors: dict[str, Any] = {}
        self.source_config: dict[str, Any] | None = None
        self.source_path: Path | None = None

    @property
    def spec(self) -> ModelSpec:
        """The architecture, read from the blocks' mixers: replacing `layers[i].mixer` updates it."""
        return ModelSpec(blocks=tuple(block.spec for block in self.layers), **self._model_fields)

    def replace_mixer(self, index: int, mixer: nn.Module, norm: RMSNorm | None = None) -> None:
        """Put `mixer` (a module from `puzzle.blocks.build_block`, with its own `.spec`) into block `index`.

        The block's pre-norm follows: a no-op mixer drops it (keep `layers[index].norm` first to put
        the block back later); a real mixer keeps the block's norm, or gets `norm` when given, or a
        fresh one (weight 1) where the block had none.
        """
        hidden_size, norm_eps = self._model_fields["hidden_size"], self._model_fields["norm_eps"]
        _check_mixer(index, mixer, None, hidden_size)
        block = self.layers[index]
        if isinstance(mixer.spec, NoOpSpec):
            if norm is not None:
                raise SpecError(f"block {index}: a no-op block has no norm, but one was given")
            block.norm = None
        elif norm is not None:
            block.norm = norm
        elif block.norm is None:
            weight = next(iter(mixer.parameters()), self.norm_f.weight)
            with torch.device(weight.device):
                block.norm = RMSNorm(hidden_size, norm_eps).to(self.norm_f.weight.dtype)
        block.mixer = mixer

    def init_cache(
        self, batch_size: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> ModelCache:
        """Empty caches for every block, on the model's device and dtype unless given."""
        weight = self.embeddings.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return ModelCache(
            [block.mixer.init_cache(batch_size, device=device, dtype=dtype) for block in self.layers]
        )

    def backbone(self, input_ids: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
        """input_ids [b, t] -> the output of block `num_blocks - 1` (default: the last) [b, t, H], before norm_f.

        The model without its head, for work that reads only block activations (importance, block inputs):
        `forward` would also make fp32 logits [b, t, V], with a 131k vocabulary 0.5 MB per token.
        """
        x = self.embeddings(input_ids)
        for block in self.layers[:num_blocks]:
            x = block(x)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        output_hidden_states: bool = False,
        cache: ModelCache | None = None,
        logits_to_keep: int = 0,
        labels: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids [b, t] (int64) -> ModelOutput with logits [b, t, V] in fp32.

        With a cache, continue from it and leave it at the end of input_ids; one token at a time
        goes through each mixer's `step`. `logits_to_keep` > 0 computes logits of the last
        positions only (generation needs one). `labels` [b, t] (usually input_ids, -100 where no loss
        is wanted) add `loss`, the shifted next-token cross-entropy (`causal_lm_loss`), as transformers'
        NemotronHForCausalLM returns it.
        """
        if labels is not None and logits_to_keep > 0:
            raise ValueError("labels need the logits of every position: pass logits_to_keep=0 with labels")
        x = self.embeddings(input_ids)
        hidden: list[torch.Tensor] | None = [x] if output_hidden_states else None
        decode = cache is not None and input_ids.shape[1] == 1 and cache.position > 0
        for index, block in enumerate(self.layers):
            if cache is None:
                x = block(x)
            elif decode:
                x = block.step(x, cache.blocks[index])
            else:
                x = block(x, cache=cache.blocks[index])
            if hidden is not None:
                hidden.append(x)
        if cache is not None:
            cache.position += input_ids.shape[1]
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(self.norm_f(x)).float()
        return ModelOutput(
            logits=logits,
            hidden_states=tuple(hidden) if hidden is not None else None,
            cache=cache,
            loss=None if labels is None else causal_lm_loss(logits, labels),
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Prompt [b, t] -> prompt + up to `max_new_tokens` tokens [b, t + n].

        Greedy when temperature == 0; otherwise samples from softmax(logits / temperature), restricted
        to the `top_k` most likely tokens when given, drawing from `generator`. The prompt is
        prefilled once; then one token per step through every mixer's `step`. Stops early once every
        row has produced `eos_token_id`.
        """
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [batch, tokens] with tokens >= 1, found shape {list(input_ids.shape)}"
            )
        cache = self.init_cache(input_ids.shape[0])
        logits = self(input_ids, cache=cache, logits_to_keep=1).logits[:, -1]
        tokens = [input_ids]
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            next_token = self._pick(logits, temperature, top_k, generator)
            if eos_token_id is not None:
                next_token = next_token.masked_fill(finished, eos_token_id)
                finished |= next_token == eos_token_id
            tokens.append(next_token[:, None])
            if step + 1 == max_new_tokens or bool(finished.all()):
                break
            logits = self(next_token[:, None], cache=cache).logits[:, -1]
        return torch.cat(tokens, dim=1)

    @staticmethod
    def _pick(
        logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
    ) -> torch.Tensor:
        """Next token per row from logits [b, V] -> [b]."""
        if temperature <= 0:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            threshold = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def save_pretrained(
        self, path: str | Path, max_shard_bytes: int | None = None, overwrite: bool = False
    ) -> Path:
        """Write a NemotronH checkpoint (config.json + safetensors) to `path`; see `puzzle.nemotron_h.save_pretrained`.

        A non-empty `path` that is not an earlier checkpoint is refused unless `overwrite=True`, which
        writes the checkpoint files beside the files already there.
        """
        # A convenience for users: the writer lives in puzzle.nemotron_h, which builds on this module, so
        # this module never imports it; the package attribute loads it on first use (puzzle._lazy).
        import puzzle

        kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        return puzzle.nemotron_h.save_pretrained(self, path, overwrite=overwrite, **kwargs)

    def extra_repr(self) -> str:
        return f"pattern={self.spec.pattern}"


def parameter_counts(model: HybridLM) -> dict[str, int]:
    """Parameters per block kind (each block's norm included), plus "embeddings", "lm_head", "norm_f"; meta-safe.

    A tied lm_head is counted once, under "embeddings".
    """
    counts: dict[str, int] = {"embeddings": model.embeddings.weight.numel()}
    if not model.spec.tie_embeddings:
        counts["lm_head"] = model.lm_head.weight.numel()
    counts["norm_f"] = model.norm_f.weight.numel()
    for block in model.layers:
        kind = block.spec.kind
        counts[kind] = counts.get(kind, 0) + sum(p.numel() for p in block.parameters())
    return counts
