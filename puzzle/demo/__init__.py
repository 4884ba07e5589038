"""The built-in demo's parent: a small hybrid trained on the Python standard library's own source files."""

from puzzle._lazy import lazy_attributes as _lazy_attributes

__getattr__, __dir__ = _lazy_attributes(__name__)  # `puzzle.demo.pipeline` etc. on first use
