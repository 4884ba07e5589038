"""The library's files: what BLD writes and every later stage reads (assemble, scoring, search, report).

    library/
      library.manifest.json               `puzzle.artifacts` manifest (written last)
      library.json                        format, parent fingerprint, BLD settings, wave plan, one entry per
                                          variant (`VariantResult.to_dict`)
      block{i}/{variant file}.safetensors the kept weights of each trained variant (`variant_file`): the
                                          mixer's `state_dict()`, keys relative to `layers.{i}.mixer`

Training lives in `puzzle.bld`; this module only reads and writes the format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from puzzle.artifacts import Artifact, ArtifactError
from puzzle.blocks import build_block
from puzzle.layout import library_variant_file
from puzzle.spec import SpecError, Variant

FORMAT_VERSION = 1
ARTIFACT_NAME = "library"
LIBRARY_FILE = "library.json"
STATUSES = ("trained", "parent", "noop", "failed")


@dataclass
class VariantResult:
    """What BLD did with one variant: `status` (one of STATUSES), tokens trained on, held-out normalised MSE
    (None when not finite) at init, after training (`trained_nmse`) and of the weights kept (`final_nmse`),
    which weights the library kept (`kept`: "trained" or "init", None for a variant not trained), and for a
    failure the step and reason.

    A trained variant keeps its initial weights when training left it worse on the held-out tokens: the
    library never holds a variant that BLD made worse than `init_child` did.
    """

    variant: Variant
    status: str
    tokens: int = 0
    init_nmse: float | None = None
    final_nmse: float | None = None
    failed_step: int | None = None
    reason: str | None = None
    trained_nmse: float | None = None
    kept: str | None = None
    # The file library.json names, when read from one: libraries written before portable names keep theirs.
    stored_file: str | None = field(default=None, repr=False, compare=False)

    @property
    def file(self) -> str | None:
        """The library file of a trained variant (None otherwise)."""
        if self.status != "trained":
            return None
        return self.stored_file or variant_file(self.variant)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.variant.to_dict(),
            "status": self.status,
            "file": self.file,
            "tokens": self.tokens,
            "init_nmse": self.init_nmse,
            "trained_nmse": self.trained_nmse,
            "final_nmse": self.final_nmse,
            "kept": self.kept,
            "failed_step": self.failed_step,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VariantResult:
        variant = Variant.from_dict({k: data[k] for k in ("block_index", "id", "spec")})
        # trained_nmse and kept are absent from libraries written before the guard (read as None).
        fields = ("tokens", "init_nmse", "final_nmse", "failed_step", "reason", "trained_nmse", "kept")
        return cls(variant, data["status"], **{k: data.get(k) for k in fields}, stored_file=data.get("file"))


@dataclass
class Library:
    """BLD's output: one result per variant, the wave plan that trained them, and where the files are."""

    directory: Path
    parent: str
    results: dict[Variant, VariantResult]
    plan: list[list[Variant]] = field(default_factory=list)
    # {wave number: step} of the waves this call resumed from a checkpoint (empty once read back from disk).
    resumed: dict[int, int] = field(default_factory=dict)

    def load_mixer(self, variant: Variant, hidden_size: int, norm_eps: float = 1e-5) -> nn.Module:
        """The trained mixer of `variant` (on the CPU), built from its spec and loaded from its file."""
        result = self.results.get(variant)
        if result is None or result.status != "trained":
            status = "absent" if result is None else result.status
            raise KeyError(
                f"variant {variant.id} of block {variant.block_index} has no trained weights ({status})"
            )
        artifact = Artifact(self.directory, ARTIFACT_NAME, FORMAT_VERSION)
        mixer = build_block(variant.spec, hidden_size, norm_eps)
        mixer.load_state_dict(artifact.load_tensors(result.file))
        return mixer


def variant_file(variant: Variant) -> str:
    """The library file BLD writes for a variant, relative to the library directory (portable names)."""
    return library_variant_file(variant.block_index, variant.id)


def variant_key(variant: Variant) -> str:
    return f"{variant.block_index}/{variant.id}"


def library_json(library: Library, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The contents of library.json: the format, the parent's fingerprint, the BLD settings (a plain dict),
    the wave plan and one entry per variant."""
    return {
        "format": FORMAT_VERSION,
        "parent": library.parent,
        "settings": dict(settings),
        "weights": "each file holds the mixer's state_dict (keys relative to layers.{i}.mixer)",
        "plan": [[variant_key(v) for v in wave] for wave in library.plan],
        "variants": [r.to_dict() for r in library.results.values()],
    }


def read_library(directory: str | Path) -> Library:
    """The library written by `build_library` in `directory`; errors name the file."""
    directory = Path(directory)
    artifact = Artifact(directory, ARTIFACT_NAME, FORMAT_VERSION)
    artifact.read_manifest()
    data = artifact.load_json(LIBRARY_FILE)
    try:
        results = [VariantResult.from_dict(entry) for entry in data["variants"]]
        by_key = {variant_key(r.variant): r.variant for r in results}
        plan = [[by_key[key] for key in wave] for wave in data["plan"]]
        parent = data["parent"]
    except (KeyError, TypeError, SpecError) as error:
        raise ArtifactError(f"{artifact.path(LIBRARY_FILE)}: malformed library ({error!r})") from error
    return Library(directory, parent, {r.variant: r for r in results}, plan)
