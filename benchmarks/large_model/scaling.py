"""A wide member of a model family derived exactly from narrow captures of it.

Members of one depth that differ only in width trace to the same ops, tensors and edges (the same names), and
each tensor's bytes and each op's cost is a polynomial of low degree in the width: weights and their matmuls
grow as width^2, activations and attention (head size fixed, heads = width / 64) as width, the vocabulary's
logits not at all. So the member at any width is the captures' arrays interpolated per entry through three
widths (degree 2, Lagrange), the structure kept; a fourth capture, left out of the fit, checks the
extrapolation (``check_held_out``). Only numbers change: the graph a capture at that width would give, without
building a model whose weights and AdamW state (16 bytes per parameter) a CPU machine cannot hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulator import OpGraph
from simulator.graph import GraphError

# arrays that must be equal in every capture of the family (what makes them one structure)
STRUCTURE = ("op_name", "op_type", "op_phase", "op_forwards_input", "tensor_producer", "tensor_output",
             "tensor_dtype", "tensor_alias_of", "tensor_persistent", "tensor_swappable", "edge_tensor",
             "edge_consumer", "edge_slot", "control_src", "control_dst", "outputs", "held_tensor", "held_read")
# arrays interpolated per entry
NUMBERS = ("op_flops_ab", "op_touched_bytes_ab", "tensor_bytes_ab", "persistent_bytes_ab")
DEGREE = 2
_NUMBER = re.compile(r"-?\d+")


def lagrange_weights(widths: tuple[int, ...], width: float) -> np.ndarray:
    """Weights w_i with p(width) = sum_i w_i * p(widths[i]) for every polynomial p of degree < len(widths)."""
    weights = np.ones(len(widths))
    for i, xi in enumerate(widths):
        for j, xj in enumerate(widths):
            if i != j:
                weights[i] *= (width - xj) / (xi - xj)
    return weights


def _interpolate(values: list[np.ndarray], weights: np.ndarray) -> np.ndarray:
    stacked = np.stack([np.asarray(v, np.float64) for v in values])
    result = np.tensordot(weights, stacked, axes=1)
    if np.all(stacked == np.round(stacked)):  # whole bytes or flops at every capture: whole at every width
        result = np.round(result)
    return np.maximum(result, 0.0)


def _interpolate_meta(values: list[Any], weights: np.ndarray) -> Any:
    first = values[0]
    if all(v == first for v in values):
        return first
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys() for v in values):
        return {key: _interpolate_meta([v[key] for v in values], weights) for key in first}
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first) for v in values):
        return [_interpolate_meta(list(items), weights) for items in zip(*values)]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        result = float(_interpolate([np.asarray(float(v)) for v in values], weights))
        return int(result) if all(isinstance(v, int) for v in values) else result
    if all(isinstance(v, str) for v in values):
        return _interpolate_shape(values, weights)
    return values[-1]


def _interpolate_shape(shapes: list[str], weights: np.ndarray) -> str:
    """A shape (or any text) whose numbers grow with the width: each number interpolated, the rest kept."""
    templates = {_NUMBER.sub("#", s) for s in shapes}
    if len(templates) != 1:
        return shapes[-1]
    numbers = np.array([[int(n) for n in _NUMBER.findall(s)] for s in shapes], np.float64)
    if numbers.size == 0:
        return shapes[0]
    found = iter(str(int(n)) for n in _interpolate(list(numbers), weights))
    return _NUMBER.sub(lambda _: next(found), shapes[0])


@dataclass(frozen=True)
class WidthFamily:
    """Captures of one family at several widths (same batch); ``at_width`` derives any member from the first
    ``DEGREE + 1`` of them."""

    widths: tuple[int, ...]
    graphs: tuple[OpGraph, ...]

    @classmethod
    def of(cls, captured: dict[int, OpGraph]) -> "WidthFamily":
        widths = tuple(sorted(captured))
        if len(widths) < DEGREE + 1:
            raise GraphError(f"a width family needs {DEGREE + 1} captures at least, got {len(widths)}")
        graphs = tuple(captured[w] for w in widths)
        for name in STRUCTURE:
            reference = getattr(graphs[0], name)
            for width, graph in zip(widths[1:], graphs[1:]):
                if not np.array_equal(getattr(graph, name), reference):
                    raise GraphError(f"the captures at widths {widths[0]} and {width} differ in {name}: not one "
                                     "structure, so no member can be derived from them")
        if len({g.batch_size for g in graphs}) != 1:
            raise GraphError("the captures of a width family must be at one batch size")
        return cls(widths, graphs)

    def at_width(self, width: int, *, fit: tuple[int, ...] | None = None) -> OpGraph:
        """The member of ``width``: every number of the captures at ``fit`` (the first three) interpolated."""
        fit = fit or self.widths[:DEGREE + 1]
        chosen = [self.graphs[self.widths.index(w)] for w in fit]
        weights = lagrange_weights(fit, float(width))
        base = chosen[0]
        arrays = {name: getattr(base, name) for name in STRUCTURE}
        arrays.update({name: _interpolate([getattr(g, name) for g in chosen], weights) for name in NUMBERS})
        shapes = np.array([g.tensor_shape for g in chosen])
        arrays["tensor_shape"] = np.array([_interpolate_shape(list(column), weights) for column in shapes.T])
        meta = _interpolate_meta([g.meta for g in chosen], weights)
        meta = dict(meta, derived={"width": int(width), "from_widths": list(fit), "degree": DEGREE})
        return OpGraph.build(**arrays, batch_size=base.batch_size, meta=meta)

    def check_held_out(self) -> dict[str, float]:
        """The last capture predicted from the first three: the largest relative error of any tensor's bytes,
        op's flops and bytes touched, and of the resident bytes (0.0: exact)."""
        if len(self.widths) <= DEGREE + 1:
            raise GraphError("no capture left out of the fit to check it with")
        width, captured = self.widths[-1], self.graphs[-1]
        derived = self.at_width(width)
        errors = {}
        for name in NUMBERS:
            truth, guess = np.asarray(getattr(captured, name), np.float64), getattr(derived, name)
            errors[name] = float(np.max(np.abs(guess - truth) / np.maximum(np.abs(truth), 1.0)))
        return errors
