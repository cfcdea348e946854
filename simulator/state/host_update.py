"""Optimizer slots on the host, one variable at a time (docs/design.md 13).

``HostState(variable, mode)`` names a trainable variable (its Keras path) whose optimizer slots live in
host memory. Mode ``host-update``: the variable's update runs on the host, beside its slots; the
gradient is copied out, the update computed there and the weight's change copied in. A plan holds
these records under ``host_state`` (``simulator.plan``, ``swap-plan/3``).
"""

from __future__ import annotations

from dataclasses import dataclass

HOST_UPDATE = "host-update"
HOST_STATE_MODES = (HOST_UPDATE,)


@dataclass(frozen=True)
class HostState:
    """A variable whose optimizer slots live on the host, and how its update runs."""

    variable: str
    mode: str = HOST_UPDATE
