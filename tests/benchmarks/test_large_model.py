"""The large-model benchmark's family and its derived members (``benchmarks.large_model``): a member's numbers are
interpolated exactly from three others, captures of another structure are refused; on the GPT family itself
(``long``: four captures) members of one depth share op names, the member left out of the fit is derived exactly
and the parameter count is Keras'."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: F401,I001 -- first: configures TF before its runtime starts

import dataclasses

import numpy as np
import pytest

import rewriter
from benchmarks.large_model.gpt import gpt, gpt_parameters
from benchmarks.large_model.scaling import WidthFamily
from simulator import GraphError, OpGraph, SwapPlan, replay
from simulator.buffers import peak_lower_bound_bytes

pytestmark = pytest.mark.tf
SMALL = dict(depth=1, vocab=32, seq_len=8)
WIDTHS = (128, 192, 256, 320)  # two heads at least: one head traces its bias otherwise (a Squeeze and BiasAdd)


def _chain(width: int) -> OpGraph:
    """A weight read and a matmul whose sizes grow as the width and its square (what a Dense layer's do)."""
    return OpGraph.build(op_name=["x", "read", "matmul"], op_type=["Placeholder", "ReadVariableOp", "MatMul"],
                         op_phase=[0, 0, 0], tensor_producer=[0, 1, 2],
                         tensor_bytes_ab=[(0, 4 * width), (4 * width * width, 0), (0, 4 * width)],
                         tensor_persistent=[False, True, False], edge_tensor=[0, 1], edge_consumer=[2, 2],
                         edge_slot=[0, 1], persistent_bytes_ab=(4 * width * width, 0), outputs=[2],
                         op_flops_ab=[(0, 0), (0, 0), (0, 2 * width * width)],
                         tensor_shape=[f"(None, {width})", f"({width}, {width})", f"(None, {width})"],
                         meta={"width": width, "model": "chain"})


def test_a_member_is_interpolated_exactly_and_other_structures_are_refused():
    family = WidthFamily.of({w: _chain(w) for w in (8, 16, 24, 40)})
    assert all(error == 0.0 for error in family.check_held_out().values())
    wide = family.at_width(4096)
    assert wide.persistent_bytes == 4 * 4096 ** 2 and wide.tensor_bytes_ab[2].tolist() == [0, 4 * 4096]
    assert wide.tensor_shape[1] == "(4096, 4096)" and wide.meta["width"] == 4096
    assert wide.meta["derived"] == {"width": 4096, "from_widths": [8, 16, 24], "degree": 2}
    other = dataclasses.replace(_chain(16), op_name=np.asarray(["x", "read", "other"]))
    with pytest.raises(GraphError, match="differ in op_name"):
        WidthFamily.of({8: _chain(8), 16: other, 24: _chain(24)})
    with pytest.raises(GraphError, match="needs 3 captures"):
        WidthFamily.of({8: _chain(8), 16: _chain(16)})


def _captured(width: int, **kwargs):
    """Built and captured in turn (a build resets Keras' names; the trace's scopes count on from there)."""
    model = gpt(width, **kwargs)
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == gpt_parameters(width, **kwargs)
    return rewriter.capture(model, 2)


@pytest.mark.long
def test_a_gpt_member_left_out_of_the_fit_is_derived_exactly():
    captures = {width: _captured(width, **SMALL) for width in WIDTHS}
    family = WidthFamily.of(captures)
    assert all(error == 0.0 for error in family.check_held_out().values())
    derived, captured = family.at_width(320).with_batch(4), captures[320].with_batch(4)
    assert np.array_equal(derived.tensor_shape, captured.tensor_shape)
    assert derived.meta["movable_state"] == captured.meta["movable_state"]
    assert replay(derived, SwapPlan.empty(derived), "v100-16gb").peak_bytes == \
        replay(captured, SwapPlan.empty(captured), "v100-16gb").peak_bytes
    wide = family.at_width(4096)  # more than this machine could build: weights and AdamW slots, 12 bytes a parameter
    assert wide.persistent_bytes > 12 * gpt_parameters(4096, **SMALL)
    assert peak_lower_bound_bytes(wide) > wide.persistent_bytes
