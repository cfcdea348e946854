"""Moving the resident state: optimizer slots kept on the host and updated there (``host_update``),
docs/design.md 13."""

from simulator.state.host_update import HOST_STATE_MODES, HOST_UPDATE, HostState

__all__ = ["HOST_STATE_MODES", "HOST_UPDATE", "HostState"]
