"""The replace-one-block scores as a file: `VariantScore`, `Scores`, scores.json and `load_scores`.

`puzzle.score.score_variants` writes them; assembly, the search of a run directory and the in-context
rounds read them without importing the scoring stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from puzzle.artifacts import Artifact
from puzzle.spec import Variant

SCORES_FILE = "scores.json"
FORMAT = 1


@dataclass(frozen=True)
class VariantScore:
    """One variant's scores. `kl`: mean KL(parent || child) in nats/token; `lm_loss_delta`: child minus parent
    mean next-token cross-entropy (nats/token); `top1`: fraction of positions where the child's most likely
    token is the parent's; `top5`: fraction where the parent's most likely token is among the child's 5 most
    likely (a tie with the child's maximum, or its 5th largest, counts as agreement); `hidden_nmse`: sum |h_child - h_parent|^2 / sum |h_parent|^2 of the final hidden state (after the
    final norm, what lm_head reads). `failed`: why there are no scores (non-finite logits), else None."""

    variant: Variant
    tokens: int
    kl: float | None
    lm_loss_delta: float | None
    top1: float | None
    top5: float | None
    hidden_nmse: float | None
    failed: str | None = None
    mixer: str = ""  # the mixer's fingerprint, when known

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["variant"] = self.variant.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VariantScore:
        return cls(**{**data, "variant": Variant.from_dict(data["variant"])})


@dataclass
class Scores:
    """The scores of the requested variants, the token count, the parent's mean loss and the input fingerprints."""

    variants: dict[Variant, VariantScore]
    tokens: int
    parent_loss: float
    inputs: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, variant: Variant) -> VariantScore:
        return self.variants[variant]


def load_scores(out_dir: str | Path) -> Scores:
    """Every variant's scores from a finished scores.json (errors name the file)."""
    artifact = Artifact(Path(out_dir), "scores", FORMAT)
    manifest = artifact.read_manifest()
    saved = artifact.load_json(SCORES_FILE)
    records = [VariantScore.from_dict(r) for r in saved["variants"]]
    return Scores(
        {r.variant: r for r in records}, saved["tokens"], saved["parent_loss"], dict(manifest.inputs)
    )
