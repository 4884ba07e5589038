"""PEP 562 module attributes for puzzle's packages: named exports and submodules load on first use.

`lazy_attributes(__name__, exports)` returns the `__getattr__` and `__dir__` a package binds, so that
`import puzzle; puzzle.presets.get_space_preset(...)` works without importing every submodule (and torch)
up front, and `dir(package)` (a notebook's completion) lists what can be reached. Standard library only:
`import puzzle` must stay light.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any


def submodule_names(package: str) -> list[str]:
    """The public submodules and subpackages of `package` (names without a leading underscore)."""
    import pkgutil  # on use: only `dir()` needs it

    return sorted(
        info.name
        for info in pkgutil.iter_modules(sys.modules[package].__path__)
        if not info.name.startswith("_")
    )


def lazy_attributes(
    package: str, exports: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`: `exports` maps a name to the module defining it; any other
    public name that is a submodule of `package` imports that submodule."""
    exports = dict(exports or {})

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        # Never a private name: `__main__` would run the CLI, and tools probe dunders like `__wrapped__`.
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports, *submodule_names(package)})

    return __getattr__, __dir__
