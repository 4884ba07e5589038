"""The built-in demo's parent: a small hybrid trained on the Python standard library's own source files."""
