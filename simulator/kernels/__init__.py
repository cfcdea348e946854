"""The replay's and the planner's per-plan loops, compiled with numba (cached on disk): a leaf package that
imports nothing else of the simulator. The golden replays (tests/simulator/test_golden.py) guard their values."""

from simulator.kernels.memory import copy_overlap, host_peak
from simulator.kernels.plan_loops import (after_ops, after_partners, plan_reads, replay_plan, safe_wait_slots,
                                         summarize)

__all__ = ["after_ops", "after_partners", "copy_overlap", "host_peak", "plan_reads", "replay_plan", "safe_wait_slots",
           "summarize"]
