"""The simulator's kernels compiled (or loaded from numba's on-disk cache) before their first real use.

On a machine's first run numba compiles the replay's kernels: 35-130 s on 2 cores, in silence, inside
whatever simulation comes first. Doing it up front on a small graph lets the caller say why it waits
(``autotune``'s CLI does); with the cache filled it takes well under a second.
"""

from __future__ import annotations

from simulator.device.presets import get_device
from simulator.params import SwapParams
from simulator.planning import plan_swaps
from simulator.replay import replay
from simulator.synthetic import training_graph


def warm_up() -> None:
    """Plan and replay a small synthetic step once: every kernel a search calls is then compiled."""
    device = get_device("v100-16gb")
    graph = training_graph(8, batch_size=2)
    replay(graph, None, device)
    replay(graph, plan_swaps(graph, SwapParams(threshold=2, lb=1, ub=4), kept_reads=device.kept_reads), device)
