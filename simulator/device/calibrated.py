"""A device model calibrated from measured steps: op times, link and copy contention measured on the
user's own hardware (``rewriter.timing.device_calibration`` makes it; ``autotune.run.calibrated_timing`` decides where it is used).
The presets it starts from are in ``simulator.device.presets``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import numpy as np

from simulator.device.presets import GB, DeviceModel
from simulator.recompute.actions import original_name
from simulator.split.actions import split_origin


class CalibrationError(ValueError):
    """A step-time calibration that cannot be made (the model does not run at the calibration batch
    sizes) or used (a graph of another model). Bad input: the CLI ends it with exit code 2."""


class CalibrationMismatchError(CalibrationError):
    """A ``CalibratedDevice`` asked for the op times of a graph of another model."""


# below this share of the graph's ops found in the calibration, the graph is another model's
MIN_OP_COVERAGE = 0.9


def graph_identity(g) -> str:
    """Digest of a graph's tensor shapes and dtypes (``N`` for the batch dimension): two captures of
    one model at any batch sizes agree, the same layers at other widths or input shapes do not.
    Tensors without a shape (hand-made graphs) count by their sizes ``a + b * batch`` instead."""
    shapes = g.tensor_shape.tolist()
    sizes = np.round(np.asarray(g.tensor_bytes_ab, dtype=np.float64)).astype(np.int64).tolist()
    text = json.dumps([[dtype, shape or size] for dtype, shape, size in zip(g.tensor_dtype.tolist(), shapes, sizes)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class CalibratedDevice(DeviceModel):
    """A device whose op times were measured on the user's own hardware (``rewriter.timing.device_calibration``).

    Per op of the calibrated model's graph (by name): ``op_seconds_ab`` = (a, b) of its time
    ``a + b * batch`` in seconds, fitted from profiled steps at ``batch_sizes`` (shares of each step)
    anchored to unprofiled step times (``measured_step_s``, one per batch size). Ops the calibration
    did not see (a graph that differs a little, e.g. by a graph rewrite) take the preset's roofline
    times ``roofline_scale``. The link fields (``h2d_bytes_per_s``, ``d2h_bytes_per_s``,
    ``transfer_latency_s``), ``copy_contention`` and ``copy_overhead_s`` are measured too, ``copies_out_wait`` is the
    placement's; the rest is the preset's
    (``preset``). It serves every batch size of a graph captured from the same model
    (``graph_fingerprint``, ``graph_identity``) and refuses others' (``CalibrationMismatchError``).
    """

    preset: str = ""
    model_name: str = ""
    graph_fingerprint: str = ""
    graph_identity: str = ""
    batch_sizes: tuple[int, ...] = ()
    measured_step_s: tuple[float, ...] = ()
    op_names: tuple[str, ...] = field(default=(), repr=False)
    op_seconds_ab: tuple[tuple[float, float], ...] = field(default=(), repr=False)
    roofline_scale: float = 1.0
    notes: tuple[str, ...] = field(default=(), repr=False)  # how the figures were measured (for reports)

    def __post_init__(self):
        super().__post_init__()
        if len(self.op_names) != len(self.op_seconds_ab):
            raise ValueError(f"{self.name}: {len(self.op_names)} op names for {len(self.op_seconds_ab)} (a, b) pairs")
        if len(self.batch_sizes) != len(self.measured_step_s):
            raise ValueError(f"{self.name}: one measured step time per calibration batch size")
        if not self.roofline_scale > 0:
            raise ValueError(f"{self.name}: roofline_scale must be > 0")

    @classmethod
    def from_preset(cls, base: DeviceModel, g, *, op_seconds_ab, batch_sizes, measured_step_s, h2d_bytes_per_s: float,
                    d2h_bytes_per_s: float, transfer_latency_s: float, copy_contention: float = 0.0,
                    copy_overhead_s: float = 0.0, copies_out_wait: bool = False,
                    roofline_scale: float = 1.0, source: str = "", notes=()) -> "CalibratedDevice":
        """``base``'s memory figures and roofline with measured times for graph ``g``'s ops
        (``op_seconds_ab[i]`` for ``g.op_name[i]``) and link; named after ``base`` and a digest of
        the measurements (a study keyed by device name never mixes two calibrations)."""
        kept = {f.name: getattr(base, f.name) for f in fields(DeviceModel)}
        kept.update(
            h2d_bytes_per_s=float(h2d_bytes_per_s), d2h_bytes_per_s=float(d2h_bytes_per_s),
            transfer_latency_s=float(transfer_latency_s), copy_contention=float(copy_contention),
            copy_overhead_s=float(copy_overhead_s), copies_out_wait=bool(copies_out_wait),
            source=source or f"calibrated on this machine; memory figures and roofline from {base.name}")
        measured = dict(
            preset=base.name, model_name=str(g.meta.get("model", "")), graph_fingerprint=g.fingerprint(),
            graph_identity=graph_identity(g), batch_sizes=tuple(int(b) for b in batch_sizes),
            measured_step_s=tuple(float(t) for t in measured_step_s), op_names=tuple(g.op_name.tolist()),
            op_seconds_ab=tuple((float(a), float(b)) for a, b in op_seconds_ab), roofline_scale=float(roofline_scale),
            notes=tuple(notes))
        digest = hashlib.sha1(repr(sorted((k, repr(v)) for k, v in {**kept, **measured}.items())).encode())
        kept["name"] = f"{base.name}-calibrated-{digest.hexdigest()[:8]}"
        return cls(**kept, **measured)

    def with_step_times(self, measured_step_s) -> "CalibratedDevice":
        """The same calibration anchored to other unprofiled step times at its batch sizes (one per
        ``batch_sizes``, e.g. timed again beside the steps it predicts, so that a change of the machine's
        load in between cancels): each op keeps its share of the step, ``a + b * batch`` is refitted."""
        new = np.asarray(measured_step_s, dtype=np.float64)
        if new.shape != (len(self.batch_sizes),) or not (new > 0).all():
            raise ValueError(f"{self.name}: one positive step time per batch size {self.batch_sizes}")
        sizes = np.asarray(self.batch_sizes, dtype=np.float64)
        design = np.stack([np.ones_like(sizes), sizes], axis=1)
        seconds = (self._ab @ design.T) * (new / np.asarray(self.measured_step_s))[None, :]
        ab, *_ = np.linalg.lstsq(design, seconds.T, rcond=None)
        rescaled = replace(self, op_seconds_ab=tuple((float(a), float(b)) for a, b in ab.T),
                           measured_step_s=tuple(float(t) for t in new),
                           roofline_scale=self.roofline_scale * float(new[-1]) / self.measured_step_s[-1],
                           notes=self.notes + ("anchored again to step times " + ", ".join(
                               f"b{b} {t * 1e3:.2f} ms" for b, t in zip(self.batch_sizes, new)),))
        return replace(rescaled, name=f"{self.preset}-calibrated-{rescaled.calibration_id[:8]}")

    def with_host_update(self, bytes_per_s: float, variable_s: float, note: str) -> "CalibratedDevice":
        """The same calibration with the host's update rate measured on this machine beside its GPU
        (``rewriter.timing.host_update_rate``), ``note`` saying how."""
        rated = replace(self, host_update_bytes_per_s=float(bytes_per_s), host_update_variable_s=float(variable_s),
                        notes=self.notes + (note,))
        return replace(rated, name=f"{self.preset}-calibrated-{rated.calibration_id[:8]}")

    def for_graph(self, g, calibrated, why: str) -> "CalibratedDevice":
        """These op times serving ``g``, the same model's step traced another way (one replica's step under a
        ``tf.distribute`` strategy, whose loss scaling, gradient pack and optimizer ops are named apart from the
        single-device step's): an op of ``g`` keeps the measured time of the op of ``calibrated`` (the graph
        calibrated) with its name and type; the others of one name scope and type take those left of
        ``calibrated``'s in the same scope and type, in graph order, where both have as many; the rest take the
        roofline times ``roofline_scale``. ``why``, with how many ops kept a time, goes to the notes."""
        index = self._op_index
        mine = list(zip(g.op_name.tolist(), g.op_type.tolist()))
        theirs = list(zip(calibrated.op_name.tolist(), calibrated.op_type.tolist()))
        by_name = dict(theirs)
        times = {name: self.op_seconds_ab[index[name]] for name, kind in mine
                 if name in index and by_name.get(name) == kind}
        left_mine, left_theirs = _by_scope_and_type(mine, times), _by_scope_and_type(theirs, times)
        for key, names in left_mine.items():
            others = [name for name in left_theirs.get(key, ()) if name in index]
            if len(others) == len(names):
                times.update((name, self.op_seconds_ab[index[other]]) for name, other in zip(names, others))
        served = replace(self, model_name=str(g.meta.get("model", "")), graph_fingerprint=g.fingerprint(),
                         graph_identity=graph_identity(g), op_names=tuple(times),
                         op_seconds_ab=tuple(times.values()),
                         notes=self.notes + (f"{why}: {len(times)} of its {g.n_ops} ops by their measured times, the "
                                             f"others by the roofline x {self.roofline_scale:.3g}",))
        return replace(served, name=f"{self.preset}-calibrated-{served.calibration_id[:8]}")

    # identity: the tables are large, so compare and hash a digest of every field once
    @cached_property
    def calibration_id(self) -> str:
        text = json.dumps([repr(getattr(self, f.name)) for f in fields(self)])
        return hashlib.sha1(text.encode()).hexdigest()

    def __eq__(self, other):
        return type(other) is type(self) and other.calibration_id == self.calibration_id

    def __hash__(self):
        return hash(self.calibration_id)

    @cached_property
    def _op_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.op_names)}

    @cached_property
    def _ab(self):
        return np.asarray(self.op_seconds_ab, dtype=np.float64).reshape(-1, 2)

    def coverage(self, g) -> float:
        """Share of ``g``'s ops that have a measured time here (a recomputation's clone has its
        original's, ``simulator.recompute.actions``), or whose original has one (a split step's part:
        ``simulator.split``; it takes the preset's estimate at its own batch, ``graph_op_seconds``)."""
        index = self._op_index
        return sum(name in index or original_name(split_origin(name)) in index
                   for name in g.op_name.tolist()) / max(g.n_ops, 1)

    def check_graph(self, g) -> float:
        """Raise ``CalibrationMismatchError`` unless ``g`` is a graph of the calibrated model; return
        the share of its ops with a measured time (1.0 for the same structure)."""
        same_structure = g.fingerprint() == self.graph_fingerprint
        if same_structure and graph_identity(g) == self.graph_identity:
            return 1.0
        graph_model = str(g.meta.get("model", ""))
        what = f"this calibration was made for model {self.model_name!r}"
        if same_structure:
            raise CalibrationMismatchError(
                f"{what}, and this graph has its structure but other tensor shapes (other layer widths or input "
                "shapes): calibrate the model the graph was captured from")
        covered = self.coverage(g)
        if graph_model != self.model_name or covered < MIN_OP_COVERAGE:
            raise CalibrationMismatchError(
                f"{what}, not for this graph (model {graph_model!r}, {100 * covered:.0f} % of its ops calibrated): "
                "calibrate the model the graph was captured from, with the same graph rewrites")
        return covered

    def graph_op_seconds(self, g):
        """Per-op time of graph ``g`` at its batch size (indexed like its ops): measured where the
        calibration saw the op (a clone costs what its original costs), else the preset's roofline
        scaled by ``roofline_scale``."""
        self.check_graph(g)
        index = self._op_index
        # a recomputation's clone ("<op>/recompute_<k>") runs its original's kernel: it takes its time
        rows = np.fromiter((index.get(name, index.get(original_name(name), -1)) for name in g.op_name.tolist()),
                           np.int64, g.n_ops)
        seen = rows >= 0
        ab = self._ab[np.maximum(rows, 0)] if len(self._ab) else np.zeros((g.n_ops, 2))
        measured = np.maximum(ab[:, 0] + ab[:, 1] * float(g.batch_size), 0.0)
        if seen.all():
            return measured
        roofline = np.asarray(DeviceModel.op_seconds(self, g.op_flops, g.op_touched_bytes), dtype=np.float64)
        return np.where(seen, measured, roofline * self.roofline_scale)

    def describe(self) -> str:
        sizes = ", ".join(f"b{b} {s * 1e3:.1f} ms" for b, s in zip(self.batch_sizes, self.measured_step_s))
        return (f"{self.name}: op times of {self.model_name} measured at batch sizes {sizes} ({len(self.op_names)} "
                f"ops); link {self.h2d_bytes_per_s / GB:.1f} GB/s in, {self.d2h_bytes_per_s / GB:.1f} GB/s out, "
                f"{self.transfer_latency_s * 1e6:.1f} us per copy; copy contention {self.copy_contention:.2f}, "
                f"{self.copy_overhead_s * 1e6:.1f} us of step per copy"
                + ("; the op after a producer waits for its copy out" if self.copies_out_wait else ""))


__all__ = ["CalibratedDevice", "CalibrationError", "CalibrationMismatchError", "MIN_OP_COVERAGE", "graph_identity"]


def _by_scope_and_type(ops: list[tuple[str, str]], taken) -> dict[tuple[str, str], list[str]]:
    """The names of ``ops`` (name, type) not in ``taken``, by (top name scope, type), in graph order."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for name, kind in ops:
        if name not in taken:
            grouped.setdefault((name.split("/", 1)[0], kind), []).append(name)
    return grouped
