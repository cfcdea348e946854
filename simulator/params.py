"""The knobs of the swap rules (docs/design.md 1.4): ``SwapParams``, checked when made.

Apart from the rules themselves (``simulator.planning``) because a plan records the parameters that
made it (``simulator.plan``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from simulator.graph import DISTANCES, ORDER_NAMES
from simulator.recompute.actions import RECOMPUTE_SCOPES

SYNC_MODES = ("none", "out", "in", "both")
SYNC_IN_MODES = ("in", "both")  # swap-ins wait for the consumer's other inputs: no trigger window
SWAP_SCOPES = ("activations", "all")  # SwapParams.tensors
TRIGGER_POLICIES = ("ancestor", "level")


class ParamsError(ValueError):
    """Swap parameters that make no sense (lb > ub, non-positive values, unknown modes)."""


RECOMPUTE_FIELDS = ("recompute", "recompute_cost", "recompute_per_tensor", "recompute_tensors")


@dataclass(frozen=True)
class SwapParams:
    """The knobs of the swap rules; see docs/design.md 1.4.

    threshold: a consumer is far when its level distance from the producer is > threshold.
    lb, ub: the swap-in trigger lies between ``ub`` and ``lb`` levels before the far consumer.
    groupby: far consumers of one tensor within ``groupby`` levels of the group's first share a swap-in.
    sync: "none", "out" (near consumers wait for the swap-out; with none, the op after the producer
      does, so the device buffer is free before the step goes on), "in" (no early trigger: the
      swap-in waits for the consumer's other inputs) or "both".
    min_bytes: tensors smaller than this (at the plan's batch size) are never swapped.
    include_types/exclude_types/exclude_scopes: filter the producing ops by type or name prefix.
    trigger: "ancestor" takes triggers among the ancestors of the first far consumer (steadier in
      real runs), "level" takes any valid op on the level.
    order: the execution order ("cto": level by level; "memory": a memory-aware topological
      order; "micro-batch": a split step's parts one after the other, see ``simulator.ordering``); the
      rewriter chains the real step in it.
    tensors: what may be swapped. "activations": the float tensors the forward pass makes, as in
      LMS. "all": also what the backward pass makes and reads much later (a U-Net's gradients that
      wait across a skip connection for the branch that joins them) and integer tensors TF keeps
      on the device (the labels Keras' sparse losses cast to int64).
    distance: what threshold, lb, ub and groupby count. "level": CTO levels, as in LMS (ops of one
      level are independent, so a level can hold many ops). "slot": steps of the execution order,
      one op each: a swap-in can then be started by the op just before its reader, and reads of
      one level that the order runs far apart (the parts of a split convolution's gradient, an op
      the memory order sinks) are far.
    keep_tensors: tensors (by name, "op:output") never swapped whatever the rules say (but a copy in that
      the plan makes, ``state.triggered_reads``, swapped always); the host-room pass (``simulator.host_room``)
      names there what it keeps on the device for the host's sake.
    recompute: which ops may be cloned to recompute a tensor for its far readers instead of keeping
      or swapping it ("none", "cheap": elementwise, activations, normalization, shapes, stateless
      random; "expensive": convolutions and matrix products too; ``simulator.recompute.actions``). The
      recomputations are made first (``simulator.recompute.choice.recomputed_graph``) and the swap
      rules then apply to the graph that holds them.
    recompute_cost: the most device seconds a recomputation may cost per byte it frees.
    recompute_per_tensor: per swapped tensor whose swap-in the step waits for, recompute it instead
      where that takes less than the wait (the link cannot hide the swap; the search's per-tensor
      pass, ``autotune.search.space.TuningProblem.evaluate``, names them in ``recompute_tensors``).
    recompute_tensors: tensors (by name) recomputed whatever the cost rule says, when they can be.
    after_copies_out: a swap-in starts only once the op it starts after (its trigger; for a
      synchronous one, the last of its consumer's other inputs) has its own swapped outputs copied
      out, instead of beside those copies: while an op waits for its swap-ins, the buffers its
      predecessor's outputs are copied out of and the swap-ins' buffers are then never on the
      device together (a later start: more waiting, less memory).
    """

    threshold: int
    lb: int = 1
    ub: int = 10
    groupby: int = 0
    sync: str = "none"
    min_bytes: int = 0
    include_types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    exclude_scopes: tuple[str, ...] = ()
    trigger: str = "ancestor"
    order: str = "cto"
    tensors: str = "activations"
    distance: str = "level"
    after_copies_out: bool = False
    keep_tensors: tuple[str, ...] = ()
    recompute: str = "none"
    recompute_cost: float = math.inf
    recompute_per_tensor: bool = False
    recompute_tensors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tensors not in SWAP_SCOPES:
            raise ParamsError(f"tensors must be one of {SWAP_SCOPES}, got {self.tensors!r}")
        if self.distance not in DISTANCES:
            raise ParamsError(f"distance must be one of {DISTANCES}, got {self.distance!r}")
        for name in ("threshold", "lb", "ub"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ParamsError(f"{name} must be a positive integer, got {value!r}")
        for name in ("groupby", "min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ParamsError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.after_copies_out, (bool, np.bool_)):
            raise ParamsError(f"after_copies_out must be true or false, got {self.after_copies_out!r}")
        object.__setattr__(self, "after_copies_out", bool(self.after_copies_out))
        if self.lb > self.ub:
            raise ParamsError(f"lb ({self.lb}) must not exceed ub ({self.ub})")
        if self.sync not in SYNC_MODES:
            raise ParamsError(f"sync must be one of {SYNC_MODES}, got {self.sync!r}")
        if self.trigger not in TRIGGER_POLICIES:
            raise ParamsError(f"trigger must be one of {TRIGGER_POLICIES}, got {self.trigger!r}")
        if self.order not in ORDER_NAMES:
            raise ParamsError(f"order must be one of {ORDER_NAMES}, got {self.order!r}")
        if self.recompute not in RECOMPUTE_SCOPES:
            raise ParamsError(f"recompute must be one of {tuple(RECOMPUTE_SCOPES)}, got {self.recompute!r}")
        cost = math.inf if self.recompute_cost is None else self.recompute_cost  # None: JSON's infinity
        if isinstance(cost, bool) or not isinstance(cost, (int, float, np.integer, np.floating)) or not cost >= 0:
            raise ParamsError(f"recompute_cost must be a non-negative number of seconds per byte, got {cost!r}")
        object.__setattr__(self, "recompute_cost", float(cost))
        if not isinstance(self.recompute_per_tensor, (bool, np.bool_)):
            raise ParamsError(f"recompute_per_tensor must be true or false, got {self.recompute_per_tensor!r}")
        object.__setattr__(self, "recompute_per_tensor", bool(self.recompute_per_tensor))
        for name in ("include_types", "exclude_types", "exclude_scopes", "keep_tensors", "recompute_tensors"):
            value = getattr(self, name)
            try:
                items = tuple(value) if not isinstance(value, str) else None
            except TypeError:
                items = None
            if items is None or not all(isinstance(item, str) for item in items):
                raise ParamsError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, items)
        for name in ("threshold", "lb", "ub", "groupby", "min_bytes"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def recomputes(self) -> bool:
        """Whether these parameters recompute anything (else the swap rules alone make the plan)."""
        return self.recompute != "none" or bool(self.recompute_tensors)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; parameters that recompute nothing leave the recompute fields out (they read
        as before recomputation existed)."""
        data = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}
        if not self.recomputes:
            for name in RECOMPUTE_FIELDS:
                del data[name]
        elif math.isinf(self.recompute_cost):
            data["recompute_cost"] = None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SwapParams":
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ParamsError(f"unknown swap parameter(s): {sorted(unknown)}")
        return cls(**data)

