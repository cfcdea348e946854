"""A small member of the GPT family on the CPU testbed with every variable's optimizer slots on the host and its
update there, without and with the writes after their reads (``simulator.state.late_writes``), and with the
weights on the host too, read on the device through copies in, without and with each copied in again for its
backward reads, and with every copy in a swap-in started by a trigger: the measured peak against the prediction, and
the weights after 3 steps against plain Keras' and the step serialized in the plan's order.

    python -m benchmarks.large_model.measured [--width 256] [--depth 2] [--seq-len 64] [--vocab 512] [--batch 8]

Prints one line per figure (``benchmarks.large_model.run`` puts them under its table). The step runs serialized
in level order (the plan's order), as the prediction assumes; the weights are compared with op determinism on.
"""

from __future__ import annotations

import argparse
import dataclasses

from benchmarks.common import start_measuring_process

MiB = 1 << 20
TRIGGERED = "the same, every copy in a swap-in started by a trigger"
TRIGGERED_PARAMS = dict(threshold=10**6, lb=1, ub=8)  # no activation swapped: the copies in alone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.large_model.measured")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    start_measuring_process()
    import numpy as np
    import tensorflow as tf

    import rewriter
    from benchmarks.large_model.gpt import gpt
    from benchmarks.models import example_batch
    from simulator import SwapParams, SwapPlan, plan_swaps, replay
    from simulator.state import (HOST_WEIGHTS, HostState, movable_state, moved_bytes, with_host_state,
                                 with_triggered_reads, writes_after_reads)

    tf.config.experimental.enable_op_determinism()
    kwargs = dict(width=args.width, depth=args.depth, vocab=args.vocab, seq_len=args.seq_len)
    plain, model = gpt(**kwargs), gpt(**kwargs)
    captured = rewriter.capture(model, args.batch)
    moved = movable_state(captured)
    x, y = example_batch(model, args.batch)
    empty = SwapPlan.empty(captured)
    before = rewriter.measure(rewriter.apply(model, empty, graph=captured, verify=False), x, y, repeats=1)
    lines, errors = [], []
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    lines.append(f"GPT width {args.width}, depth {args.depth}, sequence {args.seq_len}, vocabulary {args.vocab}, "
                 f"batch {args.batch} ({parameters:,} parameters), AdamW, serialized in level order. As captured: "
                 f"peak predicted {replay(captured, empty, 'cpu-testbed').peak_bytes / MiB:.2f} MiB, measured "
                 f"{before.peak_bytes / MiB:.2f}.")
    slots = tuple(HostState(path) for path in moved)
    weights = tuple(HostState(path, HOST_WEIGHTS) for path in moved)
    late = writes_after_reads(captured)
    on_host = with_host_state(late, weights, copies_in=False)
    triggered = with_triggered_reads(late, weights)
    on_host_triggered = with_host_state(late, triggered, copies_in=False)
    plans = {}
    for name, graph, records, plan in (
            ("slots of all variables on the host", captured, slots, SwapPlan.empty(captured)),
            ("the same, writes after their reads", late, slots, SwapPlan.empty(late)),
            ("the same, the weights on the host too", on_host, weights, SwapPlan.empty(on_host)),
            ("the same, each weight copied in again for its backward reads", on_host, weights,
             SwapPlan.from_swaps(on_host, _read_again(on_host))),
            (TRIGGERED, on_host_triggered, triggered,
             plan_swaps(on_host_triggered, SwapParams.from_dict(TRIGGERED_PARAMS)))):
        plans[name] = graph, dataclasses.replace(plan, host_state=records)
        predicted = replay(*plans[name], "cpu-testbed")
        measured = rewriter.measure(rewriter.apply(model, plans[name][1], graph=graph, verify=False), x, y, repeats=1)
        errors.append(measured.peak_bytes / predicted.peak_bytes - 1)
        lines.append(f"{name} ({moved_bytes(captured, records) / MiB:.2f} MiB of state): peak predicted "
                     f"{predicted.peak_bytes / MiB:.2f} MiB, measured {measured.peak_bytes / MiB:.2f} ({errors[-1]:+.1%}).")
    # weights after 3 steps: Keras' train_on_batch, the step serialized in the plan's order as captured (no
    # action), and with the last two plans, each on a fresh model
    chained = gpt(**kwargs)
    plain_step = rewriter.apply(chained, empty, graph=captured, verify=False)
    fresh, fresh_weights = gpt(**kwargs), gpt(**kwargs)
    graph, plan = plans["the same, writes after their reads"]
    moved_step = rewriter.apply(fresh, plan, graph=graph, verify=False)
    graph, plan = plans["the same, each weight copied in again for its backward reads"]
    weights_step = rewriter.apply(fresh_weights, plan, graph=graph, verify=False)
    losses = [[float(run(x, y)) for _ in range(3)]
              for run in (plain.train_on_batch, plain_step, moved_step, weights_step)]
    keras_w, chained_w, moved_w, weights_w = ([v.numpy() for v in m.weights + m.optimizer.variables]
                                              for m in (plain, chained, fresh, fresh_weights))
    same = all(np.array_equal(a, b) for a, b in zip(chained_w, moved_w)) and losses[1] == losses[3] \
        and all(np.array_equal(a, b) for a, b in zip(chained_w, weights_w))
    moved_by = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(keras_w[:len(model.weights)],
                                                                                [v.numpy() for v in gpt(**kwargs).weights]))
    off = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(keras_w[:len(model.weights)],
                                                                            moved_w[:len(model.weights)]))
    lines.append(f"After 3 steps (op determinism on), the last two plans against the step serialized in the captured "
                 f"order: losses {'equal' if losses[1] == losses[2] == losses[3] else 'differ'}, weights and optimizer slots "
                 f"{'bitwise equal' if same else 'DIFFER'}; against Keras' train_on_batch: losses "
                 f"{'equal' if losses[0] == losses[2] else 'differ'}, weights within {off:.1e} (the 3 steps moved them by up "
                 f"to {moved_by:.1e}): the serialized step's own rounding, not the move's (Grappler's arithmetic "
                 f"optimizer rewrites a chained step otherwise: with it off, bitwise equal to Keras').")
    # the triggered plan against the captured step chained in the plan's order (no state moved)
    graph, plan = plans[TRIGGERED]
    chained_there, fresh_triggered = gpt(**kwargs), gpt(**kwargs)
    order_step = rewriter.apply(chained_there, SwapPlan.empty(graph), graph=graph, verify=False)
    triggered_step = rewriter.apply(fresh_triggered, plan, graph=graph, verify=False)
    same_there = [float(order_step(x, y)) for _ in range(3)] == [float(triggered_step(x, y)) for _ in range(3)] \
        and all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(
            chained_there.weights + chained_there.optimizer.variables,
            fresh_triggered.weights + fresh_triggered.optimizer.variables))
    lines.append(f"The plan with every copy in a swap-in ({plan.n_swap_ins} swap-ins, "
                 f"{int((plan.in_trigger >= 0).sum())} started by a trigger) against the captured step serialized in "
                 f"its order: losses, weights and optimizer slots {'bitwise equal' if same_there else 'DIFFER'}.")
    print(" ".join(lines))
    return 0 if same and same_there and all(abs(e) <= 0.05 for e in errors) else 1


def _read_again(g) -> list:
    """Swaps of each weight's copy in (``simulator.state.with_host_state``) read again in the backward pass:
    freed after its forward readers, copied in from the weight on the host before the backward ones (synchronous
    swap-ins: the least memory)."""
    import numpy as np

    from simulator.graph import FORWARD
    from simulator.plan import Swap, SwapIn
    from simulator.state.host_update import WEIGHT_READS

    swaps = []
    for tensor in g.meta[WEIGHT_READS]:
        readers = g.edge_consumer[g.edge_tensor == tensor]
        later = tuple(int(c) for c in np.unique(readers[g.op_phase[readers] != FORWARD]))
        if later and len(later) < len(np.unique(readers)):
            swaps.append(Swap(int(tensor), False, (SwapIn(later, None),)))
    return swaps


if __name__ == "__main__":
    raise SystemExit(main())
