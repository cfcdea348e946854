"""What of a plan survived Grappler and the runtime, read from the graphs a step's first call ran."""

from rewriter.check.collected import collect_first_call, profiled_first_call
from rewriter.check.recompute_check import check_recomputes
from rewriter.check.verification import CopyWaits, Verification, check, verify, verify_first_call

__all__ = ["check", "check_recomputes", "collect_first_call", "CopyWaits", "profiled_first_call", "Verification",
    "verify", "verify_first_call"]
