"""Ops oneDNN's layout pass merges into one node after the rewrite (a filter gradient and the bias gradient of one
gradient; a convolution and the bias add that alone reads it): no plan lets a swap-in read by a filter gradient wait
for what depends on its sibling (``planning.sibling_bounds``) nor wait for an op merged with one that runs after its
reader (``planning.merge_end_positions``), and the rewriter refuses a plan whose merged ops close a cycle
(``GraphEditor.check_acyclic``) instead of building a step that hangs in its first call, which TensorFlow does not
report (docs/design.md 12)."""

from __future__ import annotations

import faulthandler
import functools
from dataclasses import replace

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import pytest
import tensorflow as tf

import rewriter
from benchmarks.models import example_batch
from benchmarks.zoo import ZOO
from rewriter.placement import memtrace
from rewriter.tf_effects.onednn import onednn_kernels
from simulator import SwapParams, plan_swaps, replay
from simulator.graph import COMBINE_MARK, PART_MARK
from simulator.plan import PlanError
from simulator.split import floor_after_splitting
from tests.rewriter.edit.test_split_parts import STEPS, _assert_close

pytestmark = pytest.mark.tf

CASE, PARTS = "custom_layer_loss", 4
# a plan of the zoo's custom_layer_loss in 4 parts that hung before: 105 swaps, level triggers among the parts
HUNG = {"threshold": 2, "ub": 8, "trigger": "level", "order": "memory", "tensors": "all", "distance": "slot"}
HANG_S = 300  # a step that hangs ends the test (and its worker) with a traceback after this


@pytest.fixture(scope="module")
def split_plan():
    th.deterministic()
    model = ZOO[CASE]
    split = floor_after_splitting(rewriter.capture(model.build(), model.batch), PARTS).split_graph.with_order("memory")
    plan = plan_swaps(split, SwapParams.from_dict(HUNG), kept_reads=rewriter.detect().kept_reads)
    return split, plan


def test_a_split_conv_step_with_swaps_between_merged_gradients_runs_and_trains_as_keras(split_plan):
    """The plan runs (measured at most 5 % over its prediction) and three steps train as Keras'."""
    split, plan = split_plan
    named = plan.to_named(split)
    build, batch = ZOO[CASE].build, ZOO[CASE].batch
    model, reference = build(), build()
    x, y = example_batch(model, batch)
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        step = rewriter.apply(model, named, batch_size=batch, verify=False)
        predicted = replay(split, plan, "cpu-testbed").peak_bytes
        measured = rewriter.measure(rewriter.apply(build(), named, batch_size=batch, verify=False), x, y, warmup=1,
                                    repeats=1).peak_bytes
        for _ in range(STEPS):
            step(x, y)
            reference.train_on_batch(x, y)
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"{plan.n_swaps} swaps, predicted {predicted} B, measured {measured} B")
    assert plan.n_swaps > 50
    _assert_close(th.weights_of(model), th.weights_of(reference))
    _assert_measured_as_predicted(measured, predicted, over_only=True)


def test_a_swap_in_started_by_what_depends_on_its_readers_sibling_is_refused(split_plan):
    """One swap-in into a filter gradient's part, started by the running combine of its sibling bias gradient's
    parts (which waits for that sibling): one clear PlanError, not a step that hangs."""
    split, plan = split_plan
    named = plan.to_named(split)
    names = [str(name) for name in split.op_name]
    for swap in named.swaps:
        for k, swap_in in enumerate(swap.swap_ins):
            reader = next((name for name in swap_in.consumers if "Conv2DBackpropFilter" in name
                           and f"{PART_MARK}1" in name), None)
            if reader is None:
                continue
            layer = reader.partition("/convolution/")[0]
            combine = f"{layer}/BiasAdd/BiasAddGrad{COMBINE_MARK}0"
            assert combine in names
            bad = replace(swap, swap_ins=(replace(swap_in, trigger=combine),))
            with pytest.raises(PlanError, match="merges ops into one node"):
                rewriter.apply(ZOO[CASE].build(), replace(named, swaps=(bad,)), batch_size=ZOO[CASE].batch,
                               verify=False)
            return
    pytest.fail("no swap-in into a filter gradient's second part")


def test_a_convolution_and_its_bias_add_left_apart_are_refused():
    """unet2d_transpose (batch 2) in 2 parts, in the cto order with level triggers: the head's convolution part 1
    runs before part 0's bias add and its own bias add part 1 after it. A swap-in started by the convolution part 1
    and read by part 0's bias add hung the step: merged with its bias add, the convolution waits for that reader
    (it ran with TF_ENABLE_ONEDNN_OPTS=0 or Grappler's dependency optimizer off). The rules now start it earlier
    (``planning.merge_end_positions``): the plan is built, runs and measures its prediction; that trigger set by
    hand is one PlanError."""
    th.deterministic()
    model = ZOO["unet2d_transpose"]
    built = model.build()  # captured, measured and refused: the step is traced once (rewriter.trace.tracing)
    g = floor_after_splitting(rewriter.capture(built, model.batch), model.batch).split_graph.with_order("cto")
    plan = plan_swaps(g, SwapParams.from_dict({**HUNG, "order": "cto"}), kept_reads=rewriter.detect().kept_reads)
    named = plan.to_named(g)
    head, reader = "unet2d_1/head_1/convolution/split_part_1", "unet2d_1/head_1/BiasAdd/split_part_0"
    slot = {str(g.op_name[op]): k for k, op in enumerate(plan.order.tolist())}
    assert slot[head] < slot[reader] < slot["unet2d_1/head_1/BiasAdd/split_part_1"]
    swap = next(swap for swap in named.swaps if any(reader in swap_in.consumers for swap_in in swap.swap_ins))
    assert all(swap_in.trigger != head for swap_in in swap.swap_ins)
    x, y = example_batch(built, model.batch)
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        measured = rewriter.measure(rewriter.apply(built, named, batch_size=model.batch, verify=False), x, y,
                                    warmup=1, repeats=1).peak_bytes
    finally:
        faulthandler.cancel_dump_traceback_later()
    predicted = replay(g, plan, "cpu-testbed").peak_bytes
    print(f"{plan.n_swaps} swaps, predicted {predicted} B, measured {measured} B")
    bad = replace(swap, swap_ins=tuple(replace(swap_in, trigger=head) if reader in swap_in.consumers else swap_in
                                       for swap_in in swap.swap_ins))
    with pytest.raises(PlanError, match="merges ops into one node"):
        rewriter.apply(built, replace(named, swaps=tuple(bad if s is swap else s for s in named.swaps)),
                       batch_size=model.batch, verify=False)
    _assert_measured_as_predicted(measured, predicted)


def _assert_measured_as_predicted(measured: int, predicted: int, over_only: bool = False) -> None:
    """The measured peak within 5 % of the prediction (``over_only``: at most 5 % over it). Both steps run in
    one-sample parts: where oneDNN gives a one-sample convolution a scratch buffer the prediction leaves out
    (``rewriter.tf_effects.onednn``; an AVX2-only CPU), a miss is reported as that known gap, not passed."""
    error = measured - predicted if over_only else abs(measured - predicted)
    if error <= 0.05 * predicted:
        return
    scratch, output = one_sample_conv_scratch_bytes()
    if scratch > output:  # a buffer larger than the probe's output: not a kernel's few bytes of bookkeeping
        pytest.xfail(f"measured {measured} B against {predicted} B predicted: oneDNN's one-sample convolutions "
                     f"take a scratch buffer here ({scratch} B in the probe), not modelled")
    raise AssertionError(f"measured {measured} B against {predicted} B predicted")


@functools.lru_cache(maxsize=1)
def one_sample_conv_scratch_bytes() -> tuple[int, int]:
    """Bytes beyond its output that a ``Conv2D`` of one sample allocates here (a 3x3 convolution of 32 x 32 x 64 to
    32 channels; 0 without oneDNN's kernels), and its output's bytes: oneDNN's scratch, which the prediction leaves
    out (``rewriter.tf_effects.onednn``)."""
    if not onednn_kernels():
        return 0, 0
    image, kernel = tf.ones((1, 32, 32, 64)), tf.ones((3, 3, 64, 32))

    @tf.function
    def convolve(image):
        with tf.device("/device:CPU:0"):
            return tf.nn.conv2d(image, kernel, 1, "SAME")

    output_bytes = int(convolve(image).shape.num_elements()) * 4
    events = memtrace.record_memory_events(convolve, image)
    allocated = events[(events["kind"] == "alloc") & events["tf_op"].str.endswith("Conv2D")]
    return max(0, int(allocated["requested_bytes"].sum()) - output_bytes), output_bytes
