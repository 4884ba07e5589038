"""Test-session settings: one torch thread per test process.

The suite runs as `pytest -n 2` on 2-core machines; two workers with several threads each would
oversubscribe the cores, and tiny models then run several times slower.
"""

import torch

torch.set_num_threads(1)
