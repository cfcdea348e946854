"""Moving the resident state: optimizer slots (and weights) kept on the host and updated there, or streamed
around an update on the device (``host_update``), and variable writes that wait for the reads they would hold
(``late_writes``), docs/design.md 13."""

from simulator.state.host_update import (HOST_STATE_MODES, HOST_UPDATE, HOST_WEIGHTS, STREAM_SLOTS, HostState,
                                         host_ops, host_working_set_bytes, movable_state, movable_weights,
                                         moved_bytes, moved_kinds, state_groups, state_refusal, where_updated,
                                         with_host_state, with_triggered_reads)
from simulator.state.late_writes import writes_after_reads

__all__ = ["HOST_STATE_MODES", "HOST_UPDATE", "HOST_WEIGHTS", "STREAM_SLOTS", "HostState", "host_ops",
    "host_working_set_bytes", "movable_state", "movable_weights", "moved_bytes", "moved_kinds", "state_groups",
    "state_refusal", "where_updated", "with_host_state", "with_triggered_reads", "writes_after_reads"]
