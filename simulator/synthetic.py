"""Graphs without TensorFlow: from a readable spec (hand-computed tests) or generated (speed runs).

A synthetic training step mirrors the shape of a real one: a forward chain with skip
connections, a backward pass that reads forward activations in reverse order, and weight updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from simulator.graph import BACKWARD, FORWARD, UPDATE, OpGraph


@dataclass(frozen=True)
class OpSpec:
    """One op of a hand-written graph. ``inputs`` name ops (output 0) or ``"op:k"``; ``outputs``
    gives the bytes of each output, an int or ``(a, b)`` for ``a + b * batch``."""

    name: str
    type: str = "Op"
    phase: int = FORWARD
    inputs: Sequence[str] = ()
    outputs: Sequence[int | tuple[float, float]] = (0,)
    flops: float | tuple[float, float] = 0.0
    touched_bytes: float | tuple[float, float] = 0.0
    control_inputs: Sequence[str] = ()
    forwards_input: bool = False
    alias_of: str | None = None  # output 0 shares the buffer of this input ("op" or "op:k")
    persistent: bool = False
    dtype: str = "float32"


@dataclass
class _Builder:
    specs: Sequence[OpSpec]
    outputs: Sequence[str] = ()
    persistent_bytes: tuple[float, float] = (0.0, 0.0)
    batch_size: int = 1
    meta: dict = field(default_factory=dict)

    def build(self) -> OpGraph:
        op_index = {spec.name: i for i, spec in enumerate(self.specs)}
        tensor_index: dict[str, int] = {}
        producer, output, tensor_bytes, dtype, persistent = [], [], [], [], []
        for i, spec in enumerate(self.specs):
            for k, size in enumerate(spec.outputs):
                tensor_index[f"{spec.name}:{k}"] = len(producer)
                producer.append(i)
                output.append(k)
                tensor_bytes.append(size if isinstance(size, tuple) else (float(size), 0.0))
                dtype.append(spec.dtype)
                persistent.append(spec.persistent)

        def tensor(ref: str) -> int:
            return tensor_index[ref if ":" in ref else f"{ref}:0"]

        alias = [-1] * len(producer)
        edge_tensor, edge_consumer, edge_slot, control_src, control_dst = [], [], [], [], []
        for i, spec in enumerate(self.specs):
            for slot, ref in enumerate(spec.inputs):
                edge_tensor.append(tensor(ref))
                edge_consumer.append(i)
                edge_slot.append(slot)
            for ref in spec.control_inputs:
                control_src.append(op_index[ref])
                control_dst.append(i)
            if spec.alias_of is not None:
                alias[tensor(f"{spec.name}:0")] = tensor(spec.alias_of)

        def linear(value):
            return value if isinstance(value, tuple) else (float(value), 0.0)

        return OpGraph.build(
            op_name=[s.name for s in self.specs],
            op_type=[s.type for s in self.specs],
            op_phase=[s.phase for s in self.specs],
            op_flops_ab=[linear(s.flops) for s in self.specs],
            op_touched_bytes_ab=[linear(s.touched_bytes) for s in self.specs],
            op_forwards_input=[s.forwards_input for s in self.specs],
            tensor_producer=producer,
            tensor_output=output,
            tensor_dtype=dtype,
            tensor_bytes_ab=tensor_bytes,
            tensor_alias_of=alias,
            tensor_persistent=persistent,
            edge_tensor=edge_tensor,
            edge_consumer=edge_consumer,
            edge_slot=edge_slot,
            control_src=control_src,
            control_dst=control_dst,
            persistent_bytes_ab=self.persistent_bytes,
            outputs=[tensor(ref) for ref in self.outputs],
            batch_size=self.batch_size,
            meta=self.meta,
        )


def from_spec(specs: Sequence[OpSpec], *, outputs: Sequence[str] = (), persistent_bytes=(0.0, 0.0),
              batch_size: int = 1, meta: dict | None = None) -> OpGraph:
    """Build an OpGraph from readable op specs (in any order that names inputs before use)."""
    return _Builder(specs, outputs, tuple(persistent_bytes), batch_size, dict(meta or {})).build()


def training_graph(n_layers: int, *, seed: int = 0, skip_every: int = 4, activation_bytes: int = 1 << 20,
                   batch_size: int = 1) -> OpGraph:
    """A ResNet-like training step with about ``4 * n_layers`` ops: forward chain with skip
    connections, backward ops reading the matching activations, one update per layer."""
    rng = np.random.default_rng(seed)
    specs: list[OpSpec] = []
    size = [(0.0, float(activation_bytes) * float(rng.uniform(0.25, 2.0))) for _ in range(n_layers)]
    flops = [(0.0, float(rng.uniform(1e8, 1e9))) for _ in range(n_layers)]
    for i in range(n_layers):
        inputs = [f"f{i - 1}"] if i else []
        if skip_every and i >= skip_every and i % skip_every == 0:
            inputs.append(f"f{i - skip_every}")
        specs.append(OpSpec(f"f{i}", "Conv2D", FORWARD, inputs, (size[i],), flops[i], (0.0, 3.0 * size[i][1])))
    specs.append(OpSpec("loss", "SparseSoftmaxCrossEntropyWithLogits", FORWARD, [f"f{n_layers - 1}"], (4, (0.0, 4.0))))
    grad = "loss:1"
    for i in reversed(range(n_layers)):
        inputs = [grad, f"f{i - 1}" if i else f"f{i}"]
        specs.append(OpSpec(f"bi{i}", "Conv2DBackpropInput", BACKWARD, inputs, (size[i - 1] if i else size[i],),
                            flops[i], (0.0, 3.0 * size[i][1])))
        specs.append(OpSpec(f"bw{i}", "Conv2DBackpropFilter", BACKWARD, [grad, f"f{i}"], (4096,), flops[i],
                            (0.0, 2.0 * size[i][1])))
        specs.append(OpSpec(f"u{i}", "AssignSubVariableOp", UPDATE, [f"bw{i}"], (), 4096.0, 8192.0))
        grad = f"bi{i}"
    return from_spec(specs, outputs=["loss"], persistent_bytes=(8192.0 * n_layers, 0.0), batch_size=batch_size,
                     meta={"model": f"synthetic-{n_layers}"})
