"""The pipeline: one run config, one resumable run directory, one typed call per stage (`puzzle.run.api.Run`).

Modules: `api` (`Run`, the typed calls and `puzzle run`'s rounds), `context` (`RunContext`: what every stage
shares: config, directory, ledger, parent, data, search problem), and one module per stage, each declaring
its inputs, its work and its outputs: `importance`, `library`, `scores`, `solutions`, `assemble`, `distill`,
`export`. run.json and its reuse rule are `puzzle.ledger`.
"""

from puzzle.ledger import RunError
from puzzle.run.api import Run
from puzzle.run.context import RunContext

__all__ = ["Run", "RunContext", "RunError"]
