"""Moving the resident state: optimizer slots kept on the host and updated there (``host_update``),
docs/design.md 13."""

from simulator.state.host_update import (HOST_STATE_MODES, HOST_UPDATE, HostState, host_ops, movable_state,
                                         state_groups, state_refusal, with_host_state)

__all__ = ["HOST_STATE_MODES", "HOST_UPDATE", "HostState", "host_ops", "movable_state", "state_groups",
    "state_refusal", "with_host_state"]
