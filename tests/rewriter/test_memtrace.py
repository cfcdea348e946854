"""rewriter.placement.memtrace.accelerator_peak on a hand-made trace: resident memory in either unit."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: F401, I001 -- first: configures TF before its runtime starts

import pandas as pd
import pytest

from rewriter.placement.memtrace import accelerator_peak

pytestmark = pytest.mark.tf


def _trace(*events: tuple) -> pd.DataFrame:
    rows = [{"time_ps": t, "kind": kind, "addr": addr, "requested_bytes": r, "allocation_bytes": a, "tf_op": op}
            for t, (kind, addr, r, a, op) in enumerate(events)]
    return pd.DataFrame(rows)


# a pre-existing 100-byte variable (a 256-byte chunk) is replaced; a swap-out copy lives on the host
TRACE = _trace(("free", 1, 100, 256, "assign"),        # not allocated in the trace: resident memory
               ("alloc", 2, 100, 256, "assign"),
               ("alloc", 3, 1000, 1024, "conv"),
               ("alloc", 4, 1000, 1024, "swap_out/conv"),
               ("free", 3, 1000, 1024, "conv"))


def is_host(op: str) -> bool:
    return op.startswith("swap_out")


@pytest.mark.parametrize("unit, resident, requested, allocated", [
    ("requested", 500, 500 - 100 + 100 + 1000, 500 - 100 + 256 + 1024),  # the free lowers it by 100
    ("chunks", 768, 768 - 256 + 100 + 1000, 768 - 256 + 256 + 1024),     # ... by its 256-byte chunk
])
def test_resident_part_is_counted_in_its_own_unit(unit, resident, requested, allocated):
    peak = accelerator_peak(TRACE, is_host_op=is_host, resident_bytes=resident, resident_unit=unit)
    assert (peak.peak_requested_bytes, peak.peak_allocated_bytes) == (requested, allocated)
    assert peak.peak_allocated_bytes >= peak.peak_requested_bytes
    assert peak.host_peak_requested_bytes == 1000 and peak.untracked_free_bytes == 256


def test_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="resident_unit"):
        accelerator_peak(TRACE, is_host_op=is_host, resident_unit="pages")


def test_a_host_buffer_the_call_before_kept_leaves_the_resident_part_alone():
    """A weight on the host replaced by its update's copy-on-write each call: the call before kept the new buffer
    (address 7, a host op's), this call frees it before its own peak. Only the host's: the resident part stays;
    read without the call before, the free of an untracked address lowers it by the whole buffer."""
    previous = _trace(("alloc", 7, 4000, 4096, "adam_w/assign_sub"), ("alloc", 8, 50, 256, "conv"),
                      ("free", 8, 50, 256, "conv"))
    call = _trace(("free", 7, 4000, 4096, ""), ("alloc", 9, 1000, 1024, "conv"), ("free", 9, 1000, 1024, "conv"))
    host = {"adam_w/assign_sub"}.__contains__
    kept = accelerator_peak(call, is_host_op=host, resident_bytes=5000, resident_unit="requested", previous=previous)
    assert kept.peak_requested_bytes == 6000 and kept.untracked_free_bytes == 0
    alone = accelerator_peak(call, is_host_op=host, resident_bytes=5000, resident_unit="requested")
    assert alone.peak_requested_bytes == 5000 and alone.untracked_free_bytes == 4096
