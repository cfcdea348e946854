"""The rewritten training step at run time: ``SwapStep`` (call it, train with it) and the variable
state it can put back (``StateSnapshot``), built by ``rewriter.step.apply_plan``."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from rewriter.trace.tracing import TracedStep
from rewriter.edit.graph_edit import AppliedSwap, SkippedSwap
from rewriter.tf_effects.grappler import fixed_grappler_config
from rewriter.placement.placements import Placement
from rewriter.edit.recompute_clones import AppliedRecompute
from rewriter.edit.split_parts import AppliedSplit
from simulator.plan import NamedPlan


class SwapStep:
    """One optimizer step of the rewritten training step: ``step(x, y) -> loss``.

    ``run(x, y)`` returns the step's logs as Keras' ``train_step`` does (the metrics dict). The step
    updates the model's variables in place. Attributes: ``plan`` (the ``NamedPlan`` that was applied),
    ``applied``/``skipped`` (per-swap records), ``recomputed`` (the recomputations built,
    ``rewriter.edit.recompute_clones.AppliedRecompute``), ``split`` (the regions run in parts,
    ``rewriter.edit.split_parts.AppliedSplit``), ``placement``, ``verification`` (what survived
    Grappler, see ``rewriter.check.verification``), ``graph_def`` (the edited GraphDef), ``batch_size``,
    ``host_updates`` (variable path -> its update's nodes placed on the host beside its optimizer slots).
    """

    def __init__(self, *, function, traced: TracedStep, graph_def, plan: NamedPlan, applied: list[AppliedSwap],
                 skipped: list[SkippedSwap], placement: Placement, swap_op: str, model=None,
                 at_batch: Callable[[int], SwapStep] | None = None, recomputed: Sequence[AppliedRecompute] = (),
                 split: Sequence[AppliedSplit] = (), host_updates: dict[str, set[str]] | None = None):
        self._function = function
        self.traced = traced
        self.graph_def = graph_def
        self.plan = plan
        self.applied = applied
        self.skipped = skipped
        self.recomputed = tuple(recomputed)
        self.split = tuple(split)
        # variable path -> the update's nodes placed on the host beside its slots (rewriter.step.host_state)
        self.host_updates = dict(host_updates or {})
        self.placement = placement
        self.swap_op = swap_op
        self.batch_size = traced.batch_size
        self.verification = None
        self.calls = 0  # how often it ran: its first call makes its constants (rewriter.timing.measurement)
        self.constant_bytes: int | None = None  # what its kernels' constants take, once a first call was profiled
        self._model = model
        self._at_batch = at_batch  # the same plan applied at another batch size (``rewriter.step.apply_plan`` gives it)
        self._others: dict[tuple[int, bool], SwapStep] = {}
        concrete = traced.concrete
        self.input_specs = [tf.TensorSpec(t.shape, t.dtype) for t in concrete.inputs[: len(traced.input_names)]]
        signature = concrete.structured_input_signature[0]
        self._n_x = len(signature[0])
        self._n_y = len(signature[1])
        self._output_structure = concrete.structured_outputs

    # -------------------------------------------------------------- facts

    @property
    def n_swap_outs(self) -> int:
        return len(self.applied)

    @property
    def n_swap_ins(self) -> int:
        return sum(len(s.swap_ins) for s in self.applied)

    @property
    def swapped_bytes(self) -> int:
        """Bytes copied to the host per step (d2h)."""
        return sum(s.bytes for s in self.applied)

    @property
    def swapped_in_bytes(self) -> int:
        """Bytes copied back per step (h2d): one copy per swap-in."""
        return sum(s.bytes * len(s.swap_ins) for s in self.applied)

    def __repr__(self) -> str:
        return (f"SwapStep(batch_size={self.batch_size}, swaps={self.n_swap_outs}, swap_ins={self.n_swap_ins}, "
                f"skipped={len(self.skipped)}, placement={self.placement.describe()!r})")

    # -------------------------------------------------------------- running

    @property
    def weighted(self) -> bool:
        """Whether the step takes a weight per sample of the loss after the labels (``rewriter.apply``)."""
        return self.traced.inputs is not None and self.traced.inputs.weight_spec is not None

    def _flat_inputs(self, x, y=None, sample_weight=None) -> list[tf.Tensor]:
        if sample_weight is not None and not self.weighted:
            raise ValueError("this step takes no sample weights: use step.for_batch(n, weighted=True)")
        if self.traced.inputs is not None:  # a Keras step: dicts by name (any key order), lists in flat order
            xs, ys = self.traced.inputs.flatten(x, y)
            if self.weighted:  # no weights given: every sample weighs 1, the unweighted loss
                ys.append(tf.ones((self.batch_of(x),)) if sample_weight is None
                          else tf.reshape(tf.convert_to_tensor(sample_weight), (-1,)))
        else:
            xs = list(x) if isinstance(x, (list, tuple)) else [x]
            ys = list(y) if isinstance(y, (list, tuple)) else [y]
        if isinstance(x, dict) and self.traced.inputs is None:
            raise TypeError("dict inputs are not supported by a traced function's step: pass a list")
        if len(xs) != self._n_x or len(ys) != self._n_y:
            raise ValueError(f"the step takes {self._n_x} input(s) and {self._n_y} label(s), "
                             f"got {len(xs)} and {len(ys)}")
        flat = []
        for value, spec in zip(xs + ys, self.input_specs):
            tensor = value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(np.asarray(value))
            if tensor.dtype != spec.dtype:
                tensor = tf.cast(tensor, spec.dtype)
            if not spec.shape.is_compatible_with(tensor.shape):
                raise ValueError(f"input of shape {tuple(tensor.shape)} does not match the step's "
                                 f"{tuple(spec.shape)} (the step was built for batch size {self.batch_size}; "
                                 "use step.for_batch(n) for another batch size)")
            flat.append(tensor)
        return flat

    def batch_of(self, x) -> int:
        first = next(iter(x.values())) if isinstance(x, dict) else x[0] if isinstance(x, (list, tuple)) else x
        return int(first.shape[0])

    def run_flat(self, *flat):
        self.calls += 1
        with fixed_grappler_config():
            outputs = self._function(*flat)
        loss = outputs[-1]
        logs = tf.nest.pack_sequence_as(self._output_structure, list(outputs[:-1]))
        return logs, loss

    def run(self, x, y=None, sample_weight=None):
        """One optimizer step; returns the logs of Keras' ``train_step`` (e.g. ``{'loss': ...}``)."""
        return self.run_flat(*self._flat_inputs(x, y, sample_weight))[0]

    def __call__(self, x, y=None):
        """One optimizer step; returns this batch's loss (a scalar tensor); y None for a model that trains
        on its inputs alone (``rewriter.trace.step_inputs.trains_itself``)."""
        return self.run_flat(*self._flat_inputs(x, y))[1]

    def zeros(self) -> list[tf.Tensor]:
        return [tf.zeros(spec.shape, spec.dtype) for spec in self.input_specs]

    def for_batch(self, batch_size: int, weighted: bool | None = None) -> "SwapStep":
        """The same plan applied at another batch size (names do not depend on it), or to the step
        that takes sample weights (``weighted``); cached."""
        weighted = self.weighted if weighted is None else bool(weighted)
        if int(batch_size) == self.batch_size and weighted == self.weighted:
            return self
        if self._at_batch is None:
            raise ValueError("this step was built from a traced function; trace it again at the other batch size")
        key = (int(batch_size), weighted)
        if key not in self._others:
            self._others[key] = self._at_batch(int(batch_size), weighted)
        return self._others[key]

    def snapshot(self) -> StateSnapshot:
        """Host copies of the step's variables (``.restore()`` puts them back)."""
        return StateSnapshot(self.traced.concrete)


class StateSnapshot:
    """Host copies of every variable a traced step captures (weights, optimizer slots, metrics, RNG
    state), to put the model back exactly as it was after a verification or measurement run."""

    def __init__(self, concrete):
        self._values = []
        for external, _ in concrete.graph.captures:
            if getattr(external, "dtype", None) != tf.resource:
                continue
            data = _handle_dtype(external)
            if data is None:
                continue
            value = tf.raw_ops.ReadVariableOp(resource=external, dtype=data)
            self._values.append((external, data, value.numpy()))

    def restore(self) -> None:
        for handle, dtype, value in self._values:
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(value, dtype=dtype))

    @property
    def nbytes(self) -> int:
        return int(sum(value.nbytes for _, _, value in self._values))


def _handle_dtype(handle):
    try:
        data = resource_variable_ops.get_eager_safe_handle_data(handle)
    except Exception:  # noqa: BLE001 -- handles without shape/type data are not variables we can read
        return None
    if not data.is_set or not data.shape_and_type:
        return None
    return tf.as_dtype(data.shape_and_type[0].dtype)
