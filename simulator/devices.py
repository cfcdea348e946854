"""Accelerator presets for the swap simulator.

Why this module exists
----------------------
The simulator predicts the peak device memory and the step time of one training
step, with and without activations swapped out to host memory, so that the
auto-tuner can search swap plans quickly and without the hardware.  It is
deliberately framework-free: it never imports TensorFlow (or numpy at import
time), so it can run on a laptop, in CI, or on the head node of a cluster.
Everything it needs to know about the target machine is the handful of numbers
in :class:`DeviceModel`: how much memory the TensorFlow process can really use,
how fast kernels run (a roofline: compute- or bandwidth-bound, plus a fixed
per-kernel cost), and how fast tensors move between device and host.

The presets below are chosen by name from the command line
(``--device v100-16gb``; see :func:`get_device`).  Every figure carries a
comment saying where it comes from: a vendor datasheet, a published
measurement, or -- marked "estimate" -- our own reasoning.  The ``cpu-testbed``
preset is calibrated on the 2-core development VM, where two logical TensorFlow
CPU devices play "accelerator" and "host" and swaps are DeepCopy ops.

Conventions
-----------
* ``capacity_bytes`` is the marketed memory size read as GiB (HBM stacks come
  in binary sizes); CUDA reports slightly less, which ``usable_fraction``
  absorbs together with the CUDA context, TensorFlow's reserve and BFC
  fragmentation.
* ``host_memory_bytes`` is the host RAM *per GPU* of the reference system
  (system RAM / number of GPUs), i.e. what one data-parallel worker can spend
  on swapped tensors.
* ``peak_flops`` is the vendor's dense FP32 (non-tensor-core) figure.  Note that
  TensorFlow >= 2.4 runs fp32 convolutions and matmuls in TF32 on tensor cores
  by default on Ampere and Hopper (``tf.config.experimental.
  enable_tensor_float_32_execution``), which is several times faster; the FP32
  figure therefore *overestimates* compute time on A100/H100/H200, which makes
  swap transfers look easier to hide than they are.  Raise ``peak_flops`` to the
  TF32 figure quoted next to each preset to model the default TF behaviour.
* Bandwidths are decimal (``GB`` = 1e9 bytes/s), as vendors and benchmarks
  quote them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

from simulator.recompute import original_name

GiB = 1024**3
GB = 1e9

_DIRECTIONS = ("h2d", "d2h")


def _is_scalar(x) -> bool:
    # numpy float64 subclasses float, so plain and numpy floats take the fast path.
    return isinstance(x, (int, float))


@dataclass(frozen=True)
class DeviceModel:
    """What the simulator needs to know of an accelerator and its link to the host."""

    name: str
    capacity_bytes: int  # physical device memory
    usable_fraction: float  # share of capacity a TF process can really use (CUDA context, BFC reserve, fragmentation)
    peak_flops: float  # dense fp32 FLOP/s that convolutions/matmuls reach (vendor FP32 figure)
    mem_bandwidth_bytes_per_s: float
    h2d_bytes_per_s: float  # effective host->device copy bandwidth (pinned), per direction
    d2h_bytes_per_s: float
    transfer_latency_s: float  # fixed cost per copy (launch + DMA setup)
    host_memory_bytes: int  # host RAM available for swapped tensors in the reference system
    op_overhead_s: float  # per-kernel launch/framework overhead
    compute_efficiency: float  # fraction of peak_flops real kernels reach
    bandwidth_efficiency: float  # fraction of mem bandwidth elementwise kernels reach
    source: str  # short citation string(s)
    # (producer type, consumer type) reads a plan must not move to a swap-in on this device
    kept_reads: tuple[tuple[str, str], ...] = ()
    # seconds the step loses per second of compute that runs while a copy does, where copies share the
    # compute's cores (the CPU testbed: fitted by rewriter.calibrate); 0 for a GPU's copy engines. A copy
    # the step waits for (a stall) runs alone and costs nothing more
    copy_contention: float = 0.0
    # seconds each copy (swap-out or swap-in) adds to the step beyond its transfer: the executor's
    # cross-device hand-off on the compute's threads (the CPU testbed: fitted by rewriter.calibrate)
    copy_overhead_s: float = 0.0

    def __post_init__(self):
        positive = (
            "capacity_bytes", "peak_flops", "mem_bandwidth_bytes_per_s",
            "h2d_bytes_per_s", "d2h_bytes_per_s", "host_memory_bytes",
        )
        for field in positive:
            if not getattr(self, field) > 0:
                raise ValueError(f"{self.name}: {field} must be > 0, got {getattr(self, field)!r}")
        for field in ("usable_fraction", "compute_efficiency", "bandwidth_efficiency"):
            v = getattr(self, field)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{self.name}: {field} must be in (0, 1], got {v!r}")
        for field in ("transfer_latency_s", "op_overhead_s", "copy_contention", "copy_overhead_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"{self.name}: {field} must be >= 0")

    # ------------------------------------------------------------------ memory
    @property
    def budget_bytes(self) -> int:
        """Bytes of device memory the simulator may plan for (capacity x usable_fraction)."""
        return int(self.capacity_bytes * self.usable_fraction)

    # ----------------------------------------------------------------- compute
    @property
    def effective_flops(self) -> float:
        """FLOP/s real convolution/matmul kernels reach."""
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s real elementwise kernels reach."""
        return self.mem_bandwidth_bytes_per_s * self.bandwidth_efficiency

    def op_seconds(self, flops, touched_bytes):
        """Roofline time of one kernel (or of many, element-wise on arrays).

        ``max(flops / effective_flops, touched_bytes / effective_bandwidth) + op_overhead_s``.
        Accepts Python/numpy scalars (returns a float) or array-likes (returns a
        numpy array; numpy is imported only in that case).
        """
        if _is_scalar(flops) and _is_scalar(touched_bytes):
            compute = flops / self.effective_flops
            memory = touched_bytes / self.effective_bandwidth
            return (compute if compute > memory else memory) + self.op_overhead_s
        import numpy as np  # lazy: the simulator core stays importable without numpy

        compute = np.asarray(flops, dtype=np.float64) / self.effective_flops
        memory = np.asarray(touched_bytes, dtype=np.float64) / self.effective_bandwidth
        return np.maximum(compute, memory) + self.op_overhead_s

    # ---------------------------------------------------------------- transfer
    def link_bytes_per_s(self, direction: str) -> float:
        """Effective copy bandwidth for ``"h2d"`` (swap-in) or ``"d2h"`` (swap-out)."""
        if direction == "h2d":
            return self.h2d_bytes_per_s
        if direction == "d2h":
            return self.d2h_bytes_per_s
        raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")

    def transfer_seconds(self, nbytes, direction: str):
        """Time of one host<->device copy: ``transfer_latency_s + nbytes / bandwidth``.

        ``direction`` is ``"h2d"`` (swap-in) or ``"d2h"`` (swap-out).  Scalars give
        a float, array-likes a numpy array.
        """
        bw = self.link_bytes_per_s(direction)
        if _is_scalar(nbytes):
            return self.transfer_latency_s + nbytes / bw
        import numpy as np

        return self.transfer_latency_s + np.asarray(nbytes, dtype=np.float64) / bw


# =============================================================================
# Calibrated from measured steps
# =============================================================================
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
    import numpy as np  # lazy, as in DeviceModel.op_seconds

    shapes = g.tensor_shape.tolist()
    sizes = np.round(np.asarray(g.tensor_bytes_ab, dtype=np.float64)).astype(np.int64).tolist()
    text = json.dumps([[dtype, shape or size] for dtype, shape, size in zip(g.tensor_dtype.tolist(), shapes, sizes)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class CalibratedDevice(DeviceModel):
    """A device whose op times were measured on the user's own hardware (``rewriter.calibrate``).

    Per op of the calibrated model's graph (by name): ``op_seconds_ab`` = (a, b) of its time
    ``a + b * batch`` in seconds, fitted from profiled steps at ``batch_sizes`` (shares of each step)
    anchored to unprofiled step times (``measured_step_s``, one per batch size). Ops the calibration
    did not see (a graph that differs a little, e.g. by a graph rewrite) take the preset's roofline
    times ``roofline_scale``. The link fields (``h2d_bytes_per_s``, ``d2h_bytes_per_s``,
    ``transfer_latency_s``), ``copy_contention`` and ``copy_overhead_s`` are measured too; the rest is the preset's
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
                    copy_overhead_s: float = 0.0,
                    roofline_scale: float = 1.0, source: str = "", notes=()) -> "CalibratedDevice":
        """``base``'s memory figures and roofline with measured times for graph ``g``'s ops
        (``op_seconds_ab[i]`` for ``g.op_name[i]``) and link; named after ``base`` and a digest of
        the measurements (a study keyed by device name never mixes two calibrations)."""
        kept = {f.name: getattr(base, f.name) for f in fields(DeviceModel)}
        kept.update(
            h2d_bytes_per_s=float(h2d_bytes_per_s), d2h_bytes_per_s=float(d2h_bytes_per_s),
            transfer_latency_s=float(transfer_latency_s), copy_contention=float(copy_contention),
            copy_overhead_s=float(copy_overhead_s),
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
        import numpy as np

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
        import numpy as np

        return np.asarray(self.op_seconds_ab, dtype=np.float64).reshape(-1, 2)

    def coverage(self, g) -> float:
        """Share of ``g``'s ops that have a measured time here (a recomputation's clone has its
        original's, ``simulator.recompute``)."""
        index = self._op_index
        return sum(name in index or original_name(name) in index for name in g.op_name.tolist()) / max(g.n_ops, 1)

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
        import numpy as np

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
                f"{self.copy_overhead_s * 1e6:.1f} us of step per copy")


# =============================================================================
# Presets
# =============================================================================
# Shared citations.
_V100_DS = ("NVIDIA Tesla V100 datasheet, "
            "https://images.nvidia.com/content/technologies/volta/pdf/tesla-volta-v100-datasheet-letter-fnl-web.pdf")
_A100_DS = ("NVIDIA A100 datasheet, "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet, "
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H200_DS = "NVIDIA H200 Tensor Core GPU product page / datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_TF_RESERVE = ("TensorFlow gpu_device.cc MinSystemMemory(): reserves 1050 MiB (cc 7.x), "
               "1536 MiB (cc 8.x), 1800 MiB (cc >= 9) of the free GPU memory")
_PCIE3_MEAS = ("bandwidthTest pinned over PCIe 3.0 x16: H2D 12.15 GB/s, D2H 12.89 GB/s "
               "(https://github.com/mpicbg-scicomp/gearshifft/pull/82); V100 PCIe3 ingress ~12 GB/s "
               "(https://github.com/ZaidQureshi/bam/issues/54)")
_PCIE4_MEAS = ("nvbandwidth on A100-SXM4-80GB, PCIe 4.0 x16: H2D 24.8 GB/s, D2H ~25 GB/s "
               "(https://forums.developer.nvidia.com/t/asymmetric-pcie-bandwidth-in-bidirectional-"
               "transfers-h2d-drops-56-while-d2h-maintains-performance/352186); A100-SXM4-40GB H2D "
               "25.13 GB/s (https://github.com/NVIDIA/nvbandwidth/issues/42)")
_PCIE5_MEAS = ("H100 PCIe 5.0 x16: D2H 52.8 GB/s (https://github.com/NVIDIA/nvbandwidth/issues/24); "
               "64 GB/s/direction theoretical; 50 GB/s = the ~78% of theoretical measured on PCIe 3/4")
_NVLINK2_MEAS = ("The Next Platform, 'NVLink Shines on POWER9 for AI and HPC Tests' (2017-12-15): "
                 "68 GB/s CPU->GPU on a 4-GPU AC922, 45.9 GB/s on 6-GPU "
                 "(https://www.nextplatform.com/2017/12/15/nvlink-shines-power9-ai-hpc-tests/)")
_LMS_PAPER = ("Le, Imai, Negishi, Kawachiya: 'TFLMS: Large Model Support in TensorFlow by Graph Rewriting', "
              "arXiv:1807.02037; 'Automatic GPU Memory Management for Large Neural Models in TensorFlow', ISMM 2019")

# Estimates shared by all GPU presets (no vendor figure exists for these):
#  - transfer_latency_s = 10e-6: estimate -- cudaMemcpyAsync launch (a few us) + DMA setup +
#    TensorFlow's per-copy bookkeeping (EventMgr polling); small next to a swap of >= 1 MB.
#  - op_overhead_s = 5e-6: estimate -- CUDA kernel launch ~2-4 us plus TF executor dispatch;
#    the usual "~5 us per op" rule of thumb for TF graph mode on GPU.
#  - compute_efficiency = 0.6: estimate -- cuDNN/cuBLAS fp32 kernels reach ~50-75% of peak on
#    ResNet-like layers; 0.6 is the middle.
#  - bandwidth_efficiency = 0.8: estimate anchored on a measurement -- a device memcopy on
#    A100-40GB reaches 1355 of 1555 GB/s = 0.87 (https://github.com/PTsolvers/gpu-workshop-JuliaCon23/issues/7);
#    TF elementwise kernels (strided, broadcast, fused epilogues) do somewhat worse.
_GPU_LATENCY_S = 10e-6
_GPU_OP_OVERHEAD_S = 5e-6
_GPU_COMPUTE_EFF = 0.6
_GPU_BW_EFF = 0.8

V100_16GB = DeviceModel(
    # Tesla V100 SXM2 16GB (the IBM LMS paper's GPU) on an x86 host with a PCIe 3.0 x16 host
    # link -- DGX-1, AWS p3, most clusters.  The V100 *PCIe card* is 14 TFLOPS fp32, else the same.
    name="v100-16gb",
    capacity_bytes=16 * GiB,  # 16 GB HBM2 (V100 datasheet); CUDA reports ~15.8 GiB
    # estimate: ~15.8 GiB CUDA-visible - ~0.4 GiB CUDA context - 1050 MiB TF reserve (cc 7.0,
    # gpu_device.cc) = ~14.4 GiB = 0.90 of 16 GiB; minus ~2% BFC fragmentation -> 0.88
    usable_fraction=0.88,
    peak_flops=15.7e12,  # V100 SXM2 single-precision 15.7 TFLOPS (V100 datasheet)
    mem_bandwidth_bytes_per_s=900 * GB,  # HBM2 900 GB/s (V100 datasheet)
    h2d_bytes_per_s=12.15 * GB,  # measured pinned H2D over PCIe 3.0 x16 (gearshifft PR #82; BaM #54: ~12 GB/s on V100)
    d2h_bytes_per_s=12.9 * GB,  # measured pinned D2H over PCIe 3.0 x16 (gearshifft PR #82)
    transfer_latency_s=_GPU_LATENCY_S,  # estimate, see _GPU_LATENCY_S
    host_memory_bytes=64 * GiB,  # DGX-1: 512 GB DDR4 / 8 GPUs (https://en.wikipedia.org/wiki/Nvidia_DGX); AWS p3.2xlarge: 61 GiB/GPU
    op_overhead_s=_GPU_OP_OVERHEAD_S,  # estimate
    compute_efficiency=_GPU_COMPUTE_EFF,  # estimate
    bandwidth_efficiency=_GPU_BW_EFF,  # estimate, anchored on a measured memcopy
    source=f"{_V100_DS}; {_PCIE3_MEAS}; {_TF_RESERVE}; DGX-1 512 GB RAM (Wikipedia 'Nvidia DGX')",
)

V100_16GB_NVLINK = DeviceModel(
    # The LMS paper's machine: IBM Power System AC922, POWER9 CPUs attached to the Tesla V100
    # SXM2 16GB by NVLink 2.0 (4-GPU config: 3 bricks x 25 GB/s = 75 GB/s per direction per GPU;
    # IBM's TFLMS case study quotes 150 GB/s, which is the bidirectional sum --
    # https://developer.ibm.com/linuxonpower/2018/07/27/tensorflow-large-model-support-case-study-3d-image-segmentation/).
    # Same GPU as v100-16gb, faster host link.
    name="v100-16gb-nvlink",
    capacity_bytes=16 * GiB,  # 16 GB HBM2 (V100 datasheet)
    usable_fraction=0.88,  # estimate, same GPU and TF reserve as v100-16gb
    peak_flops=15.7e12,  # V100 SXM2 single-precision (V100 datasheet)
    mem_bandwidth_bytes_per_s=900 * GB,  # V100 datasheet
    h2d_bytes_per_s=68 * GB,  # measured CPU->GPU on a 4-GPU AC922 (The Next Platform, 2017-12-15); 75 GB/s theoretical
    d2h_bytes_per_s=68 * GB,  # estimate: NVLink bricks are full-duplex, assume the same as the measured CPU->GPU figure
    transfer_latency_s=_GPU_LATENCY_S,  # estimate, see _GPU_LATENCY_S
    # estimate: AC922 holds up to 2 TB of DDR4; the paper's RAM size is not given here, so take
    # a common 512 GiB, 4-GPU node -> 128 GiB per GPU
    host_memory_bytes=128 * GiB,
    op_overhead_s=_GPU_OP_OVERHEAD_S,  # estimate
    compute_efficiency=_GPU_COMPUTE_EFF,  # estimate
    bandwidth_efficiency=_GPU_BW_EFF,  # estimate
    source=f"{_V100_DS}; {_NVLINK2_MEAS}; {_LMS_PAPER}; {_TF_RESERVE}",
)

A100_40GB = DeviceModel(
    # A100 SXM4 40GB, PCIe 4.0 x16 host link (DGX A100 / HGX A100).
    # TF32 (TF's default for fp32 conv/matmul on Ampere): 156 TFLOPS dense (A100 datasheet).
    name="a100-40gb",
    capacity_bytes=40 * GiB,  # 40 GB HBM2 (A100 datasheet); CUDA reports 42405855232 B = 40441 MiB
    # estimate: 40441 MiB CUDA-visible (deviceQuery, https://upb-pc2.atlassian.net/wiki/spaces/PC2DOK/
    # pages/1900609) - ~0.5 GiB context - 1536 MiB TF reserve (cc 8.0) = 0.94 of 40 GiB; -2% fragmentation
    usable_fraction=0.92,
    peak_flops=19.5e12,  # FP32 19.5 TFLOPS (A100 datasheet); TF32 tensor core 156 TFLOPS dense
    mem_bandwidth_bytes_per_s=1555 * GB,  # 1,555 GB/s HBM2 (A100 datasheet, 40GB SXM)
    h2d_bytes_per_s=24.8 * GB,  # measured nvbandwidth H2D on A100 SXM4, PCIe 4.0 x16 (NVIDIA forum; nvbandwidth #42: 25.13)
    d2h_bytes_per_s=24.8 * GB,  # same measurement reports D2H ~25 GB/s (NVIDIA forum thread)
    transfer_latency_s=_GPU_LATENCY_S,  # estimate
    host_memory_bytes=128 * GiB,  # DGX A100 (320GB): 1 TB RAM / 8 GPUs (Wikipedia 'Nvidia DGX')
    op_overhead_s=_GPU_OP_OVERHEAD_S,  # estimate
    compute_efficiency=_GPU_COMPUTE_EFF,  # estimate
    bandwidth_efficiency=_GPU_BW_EFF,  # estimate
    source=f"{_A100_DS}; {_PCIE4_MEAS}; {_TF_RESERVE}; DGX A100 1 TB RAM (Wikipedia 'Nvidia DGX')",
)

A100_80GB = DeviceModel(
    # A100 SXM4 80GB, PCIe 4.0 x16 host link.  TF32: 156 TFLOPS dense (A100 datasheet).
    name="a100-80gb",
    capacity_bytes=80 * GiB,  # 80 GB HBM2e (A100 datasheet)
    # estimate: CUDA-visible ~99% of 80 GiB - ~0.5 GiB context - 1536 MiB TF reserve (cc 8.0)
    # = ~0.97; minus ~2% fragmentation -> 0.95
    usable_fraction=0.95,
    peak_flops=19.5e12,  # FP32 19.5 TFLOPS (A100 datasheet); TF32 156 TFLOPS dense
    mem_bandwidth_bytes_per_s=2039 * GB,  # 2,039 GB/s HBM2e (A100 datasheet, 80GB SXM)
    h2d_bytes_per_s=24.8 * GB,  # measured on this exact GPU (A100-SXM4-80GB), PCIe 4.0 x16, NVIDIA forum
    d2h_bytes_per_s=24.8 * GB,  # same thread: D2H ~25 GB/s
    transfer_latency_s=_GPU_LATENCY_S,  # estimate
    host_memory_bytes=256 * GiB,  # DGX A100 640GB: 2 TB RAM / 8 GPUs (NVIDIA DGX A100 datasheet)
    op_overhead_s=_GPU_OP_OVERHEAD_S,  # estimate
    compute_efficiency=_GPU_COMPUTE_EFF,  # estimate
    bandwidth_efficiency=_GPU_BW_EFF,  # estimate
    source=f"{_A100_DS}; {_PCIE4_MEAS}; {_TF_RESERVE}; DGX A100 640GB: 2 TB RAM",
)

H100_80GB = DeviceModel(
    # H100 SXM5 80GB, PCIe 5.0 x16 host link (DGX/HGX H100).
    # TF32 tensor core: 494.7 TFLOPS dense (989 with sparsity) (H100 datasheet).
    name="h100-80gb",
    capacity_bytes=80 * GiB,  # 80 GB HBM3 (H100 datasheet)
    # estimate: CUDA-visible ~99% of 80 GiB - ~0.6 GiB context - 1800 MiB TF reserve (cc 9.0)
    # = ~0.96; minus ~2% fragmentation -> 0.94
    usable_fraction=0.94,
    peak_flops=67e12,  # FP32 67 TFLOPS (H100 SXM datasheet); TF32 494.7 TFLOPS dense
    mem_bandwidth_bytes_per_s=3350 * GB,  # 3.35 TB/s HBM3 (H100 SXM datasheet)
    # estimate anchored on measurements: PCIe 5.0 x16 is 64 GB/s per direction; H100 D2H measured
    # 52.8 GB/s (nvbandwidth #24); 50 GB/s = 78% of theoretical, the ratio measured on PCIe 3 and 4
    h2d_bytes_per_s=50 * GB,
    d2h_bytes_per_s=50 * GB,  # same reasoning
    transfer_latency_s=_GPU_LATENCY_S,  # estimate
    # 8x H100 SXM nodes ship 2 TB RAM (DGX H100 datasheet; MLPerf Inference v3.1 Dell XE9680 system
    # description, https://github.com/mlcommons/inference_results_v3.1/blob/main/closed/Dell/systems/
    # XE9680_H100_SXM_80GBx8_TRT.json) -> 2 TB / 8 GPUs
    host_memory_bytes=256 * GiB,
    op_overhead_s=_GPU_OP_OVERHEAD_S,  # estimate
    compute_efficiency=_GPU_COMPUTE_EFF,  # estimate
    bandwidth_efficiency=_GPU_BW_EFF,  # estimate
    source=f"{_H100_DS}; {_PCIE5_MEAS}; {_TF_RESERVE}; 8-GPU H100 nodes: 2 TB RAM (DGX H100; MLPerf v3.1 XE9680)",
)

H200_141GB = DeviceModel(
    # H200 SXM 141GB: the H100's GH100 compute with HBM3e; same PCIe 5.0 x16 host link.
    # TF32 tensor core: 494.7 TFLOPS dense (989 with sparsity), as H100.
    name="h200-141gb",
    capacity_bytes=141 * GiB,  # 141 GB HBM3e (H200 datasheet); nvidia-smi shows ~140.4 GiB
    # estimate: ~140.4 GiB CUDA-visible - ~0.6 GiB context - 1800 MiB TF reserve (cc 9.0) = ~0.98;
    # minus ~2% fragmentation -> 0.96
    usable_fraction=0.96,
    peak_flops=67e12,  # FP32 67 TFLOPS (H200 SXM datasheet)
    mem_bandwidth_bytes_per_s=4800 * GB,  # 4.8 TB/s HBM3e (H200 datasheet)
    h2d_bytes_per_s=50 * GB,  # estimate: same PCIe 5.0 x16 host interface as H100 (see h100-80gb)
    d2h_bytes_per_s=50 * GB,  # estimate: same as H100
    transfer_latency_s=_GPU_LATENCY_S,  # estimate
    # 8x H200 node: 2 TB RAM, PCIe Gen5 x16 host link (MLPerf Inference v4.1 NVIDIA H200-SXM-141GBx8
    # system description, https://raw.githubusercontent.com/mlcommons/inference_results_v4.1/main/closed/
    # NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json) -> 2 TB / 8 GPUs
    host_memory_bytes=256 * GiB,
    op_overhead_s=_GPU_OP_OVERHEAD_S,  # estimate
    compute_efficiency=_GPU_COMPUTE_EFF,  # estimate
    bandwidth_efficiency=_GPU_BW_EFF,  # estimate
    source=f"{_H200_DS}; {_PCIE5_MEAS}; {_TF_RESERVE}; 8-GPU H200 node: 2 TB RAM (MLPerf v4.1 NVIDIA system)",
)

# -----------------------------------------------------------------------------
# cpu-testbed: the development VM (2-core AMD EPYC "Genoa" -- family 25 model 17 -- KVM guest,
# 24 GiB RAM).  Two logical TF CPU devices play accelerator (/CPU:0) and host (/CPU:1); a swap
# is a tf.raw_ops.DeepCopy between them.  The compute, bandwidth and copy figures are a roofline of
# microbenchmarks, measured on 2026-11-30 between 03:15 and 03:27 UTC (TF 2.21, fp32, graph mode,
# TF_CPU_ALLOCATOR_USE_BFC=true as in the testbed; each figure the median over 6 runs in which other
# processes used < 1 % of the CPU) by the measurements rewriter.calibrate.measure_preset now makes in
# the repository (matmul, elementwise add, tiny-op chain, chained copies).  Re-measured with it on
# 2026-12-02 under a load average of 9 (other jobs on the 2 cores): matmul 444 GFLOP/s, elementwise
# 17.9 GB/s, 0.41 us per tiny op, copies of 64-256 MiB 19.4 GB/s, 1.8 us per small copy: the machine's
# figures move with its load, so the ones below are kept as an estimate of the quiet machine.
# STEP TIMES from this roofline are a datasheet-style estimate: against measured steps on the testbed
# (python -m benchmarks step-time, 4 models x 7 plans, five runs) they were off by median 9-45 %, worst 49-88 %;
# rewriter.calibrate (autotune --calibrate, the default for a measured run) replaces them with the
# model's own measured op times, link and copy contention.
# Modelling caveat: unlike a GPU's copy engines, DeepCopy runs on the same two cores as the
# "kernels", so on this testbed swaps do NOT overlap freely with compute.
# oneDNN pairs MaxPool with its gradient through a hidden workspace found by the direct edge;
# a gradient reading the pooled input through a copy loses the pairing and routes ties differently
# (about 1% weight difference after 3 steps on a 3D U-Net). The read stays on the device.
ONEDNN_POOL_READS = tuple((pool, grad) for pool, grad in (
    ("MaxPool", "MaxPoolGrad"), ("MaxPoolV2", "MaxPoolGradV2"), ("MaxPool3D", "MaxPool3DGrad")))

CPU_TESTBED = DeviceModel(
    name="cpu-testbed",
    kept_reads=ONEDNN_POOL_READS,
    capacity_bytes=24 * GiB,  # this machine's RAM (MemTotal 24684096 kB ~ 23.5 GiB; nominal 24 GiB)
    usable_fraction=1.0,  # no driver/allocator reserve on a CPU device; the budget is set by the tool
    # measured: tf.linalg.matmul 2048x2048x2048 fp32, 204 GFLOP/s (clean-run range 196-215)
    peak_flops=204e9,
    # measured: tf.add of two 256 MiB fp32 tensors, bytes touched = 2 reads + 1 write = 768 MiB,
    # 26.4 GB/s (range 25.5-31.7); a read-only tf.reduce_sum of 256 MiB gives 28.1 GB/s
    mem_bandwidth_bytes_per_s=26.4 * GB,
    # measured: DeepCopy ping-ponged between /CPU:0 and /CPU:1 (each copy = one swap), marginal
    # time per copy in a chain, tensors of 64-256 MiB: 13.3 GB/s (range 12.1-15.7).  Smaller
    # tensors are partly cache-resident (4-16 MiB copies run at 16-27 GB/s).
    h2d_bytes_per_s=13.3 * GB,
    d2h_bytes_per_s=13.3 * GB,  # same measurement: the ping-pong alternates both directions
    # measured: marginal cost of a ping-ponged DeepCopy of a 4-byte tensor, 4.9-6.7 us (3 runs);
    # with 13.3 GB/s this predicts 85 us for 1 MiB (measured median 86 us) and 5.1 ms for
    # 64 MiB (measured 4.8 ms).  A same-device DeepCopy costs only ~0.7 us: most of the fixed
    # cost is TF's send/recv between the two logical devices.
    transfer_latency_s=6e-6,
    # both logical devices share the same physical RAM: device + host usage together must fit
    host_memory_bytes=24 * GiB,
    # measured: marginal cost of one tiny op (alternating Sin/Maximum on a 1-element tensor) in
    # a 10000-op chain inside one tf.function, 0.56 us (range 0.54-0.62).  This is the executor's
    # inline-dispatch floor; an eager op costs ~9 us and each tf.function call ~0.3 ms.
    op_overhead_s=0.56e-6,
    # measured: mean of MatMul 1024^3 (152), 3x3 Conv2D N=8 56x56x64->64 forward (187),
    # backprop-input (187) and backprop-filter (148 GFLOP/s) = 168.5 GFLOP/s = 0.82 of peak_flops
    compute_efficiency=0.82,
    bandwidth_efficiency=1.0,  # mem_bandwidth is itself the measured elementwise (tf.add) rate
    source=("roofline of microbenchmarks on this VM (rewriter.calibrate.measure_preset: TF 2.21, 2-core AMD EPYC KVM "
            "guest, TF_CPU_ALLOCATOR_USE_BFC=true), 2026-11-30, median of 6 uncontended runs; an estimate of the "
            "quiet machine only; step times: calibrate the model (rewriter.calibrate) for measured ones"),
)

DEVICES: dict[str, DeviceModel] = {
    d.name: d
    for d in (V100_16GB, V100_16GB_NVLINK, A100_40GB, A100_80GB, H100_80GB, H200_141GB, CPU_TESTBED)
}


class UnknownDeviceError(KeyError, ValueError):
    """Raised by :func:`get_device` for a name that is not a preset.

    Derives from both KeyError (it is a failed lookup) and ValueError (it is a bad
    CLI argument), so either ``except`` clause catches it.
    """

    def __str__(self) -> str:  # KeyError would repr() the message; print it plainly
        return str(self.args[0]) if self.args else ""


def get_device(name: str) -> DeviceModel:
    """Return the preset called ``name`` (case-insensitive; ``_`` and ``-`` are equivalent)."""
    key = str(name).strip().lower().replace("_", "-")
    try:
        return DEVICES[key]
    except KeyError:
        known = ", ".join(DEVICES)
        raise UnknownDeviceError(f"unknown device {name!r}; known: {known}") from None


def preset_for_gpu(gpu_name: str) -> str | None:
    """The preset modelling the GPU TensorFlow names ``gpu_name`` ("Tesla V100-SXM2-16GB",
    "NVIDIA A100 80GB PCIe", ...), or None for a GPU without one."""
    lowered = gpu_name.lower().replace(" ", "")
    for family, preset in (("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-40gb"), ("v100", "v100-16gb")):
        if family in lowered:
            return "a100-80gb" if family == "a100" and "80gb" in lowered else preset
    return None


# -----------------------------------------------------------------------------
# Host memory for swapped tensors beside a GPU. Copies to and from a GPU land in TensorFlow's pinned
# (page-locked) host allocator ``gpu_host_bfc``, which grows on demand up to a limit:
# GPUOptions.experimental.gpu_host_mem_limit_in_mb when set, else the environment variable
# TF_GPU_HOST_MEM_LIMIT_IN_MB, default 2**17 MiB = 128 GiB (gpu_process_state.cc,
# GPUProcessState::GetGpuHostAllocator, TF 2.15 to 2.21; 2**16 MiB = 64 GiB in older releases). It is
# read once, when the allocator is first needed; past it a copy out fails with ResourceExhausted on the
# host, and pinned pages cannot be paged out (TFLMS issues #33, #35), so the machine must keep a margin.
PINNED_LIMIT_ENV = "TF_GPU_HOST_MEM_LIMIT_IN_MB"
DEFAULT_PINNED_LIMIT_BYTES = 2**17 * 2**20
HOST_MARGIN_FRACTION = 0.10  # estimate: the OS, the Python process, TensorFlow and the input pipeline
HOST_MARGIN_MIN_BYTES = 4 * GiB


def pinned_limit_bytes(value: str | None) -> int:
    """TensorFlow's pinned host memory limit for the given value of TF_GPU_HOST_MEM_LIMIT_IN_MB (None:
    unset). TF reads it as an int64 count of MiB; a value it cannot parse leaves the default."""
    if value is None or not str(value).strip():
        return DEFAULT_PINNED_LIMIT_BYTES
    try:
        return int(str(value).strip()) * 2**20
    except ValueError:
        return DEFAULT_PINNED_LIMIT_BYTES


def host_usable_bytes(physical_bytes: int) -> int:
    """Physical RAM less the margin the machine needs besides pinned copies."""
    margin = max(HOST_MARGIN_MIN_BYTES, int(physical_bytes * HOST_MARGIN_FRACTION))
    return max(0, int(physical_bytes) - margin)


@dataclass(frozen=True)
class HostBudget:
    """Host memory a plan may fill with copies beside a GPU: the least of three limits."""

    preset_bytes: int  # the device preset's host RAM per GPU
    pinned_limit_bytes: int  # TensorFlow's pinned-memory limit in force
    usable_bytes: int  # this machine's physical RAM less a margin
    # "default", "environment" (set by the user), "raised" (by the tool before TensorFlow started) or
    # "raised late" (after TensorFlow was imported: in force only if its GPU runtime had not started)
    pinned_limit_source: str = "default"

    @property
    def bytes(self) -> int:
        return min(self.preset_bytes, self.pinned_limit_bytes, self.usable_bytes)

    @property
    def limited_by(self) -> str:
        """Which limit is the least: "preset", "pinned limit" or "physical memory"."""
        return min((self.preset_bytes, "preset"), (self.usable_bytes, "physical memory"),
                   (self.pinned_limit_bytes, "pinned limit"))[1]

    def describe(self) -> str:
        limit = self.pinned_limit_bytes / GiB
        text = (f"host copies up to {self.bytes / GiB:.1f} GiB (least of the preset's {self.preset_bytes / GiB:.1f} GiB, "
                f"TensorFlow's pinned-memory limit {limit:.1f} GiB ({PINNED_LIMIT_ENV}, {self.pinned_limit_source}) and "
                f"this machine's RAM less a margin, {self.usable_bytes / GiB:.1f} GiB)")
        if self.limited_by == "pinned limit" and self.usable_bytes > self.pinned_limit_bytes:
            wanted = min(self.preset_bytes, self.usable_bytes) // 2**20
            text += (f"; the machine has more: set {PINNED_LIMIT_ENV}={wanted} before TensorFlow starts to use it"
                     + (" (it was set in the environment, so the tool left it)" if self.pinned_limit_source == "environment"
                        else " (TensorFlow had started before the tool could raise it)"))
        elif self.pinned_limit_source == "raised late":
            text += (f"; {PINNED_LIMIT_ENV} was raised after TensorFlow was imported: if its GPU runtime had started, "
                     f"the limit in force is {DEFAULT_PINNED_LIMIT_BYTES / GiB:.0f} GiB (import rewriter first)")
        return text


def pinned_limit_to_set(current: str | None, physical_bytes: int) -> str | None:
    """The value of TF_GPU_HOST_MEM_LIMIT_IN_MB that lets pinned copies fill the machine's usable RAM,
    when it is unset and the default is below that; None to leave it (set by the user, or enough)."""
    if current is not None and str(current).strip():
        return None
    usable = host_usable_bytes(physical_bytes)
    return str(usable // 2**20) if usable > DEFAULT_PINNED_LIMIT_BYTES else None


# TensorFlow keeps this much of a GPU's free memory for CUDA and cuDNN (gpu_device.cc MinSystemMemory,
# see _TF_RESERVE), by compute capability major version; the CUDA context takes about 0.5 GiB more.
_TF_RESERVE_MIB = ((9, 1800), (8, 1536), (0, 1050))
_CUDA_CONTEXT_BYTES = GiB // 2
_FRAGMENTATION = 0.02  # as in the presets' usable_fraction


def usable_gpu_bytes(total_bytes: int, compute_capability_major: int | None = None) -> int:
    """The budget of a GPU without a preset, from its reported total memory: what TensorFlow leaves
    after the CUDA context and its own reserve, less ~2 % for BFC fragmentation (the presets' rule)."""
    major = compute_capability_major if compute_capability_major is not None else 0
    reserve = next(mib for cc, mib in _TF_RESERVE_MIB if major >= cc) * 2**20
    return max(0, int((int(total_bytes) - _CUDA_CONTEXT_BYTES - reserve) * (1 - _FRAGMENTATION)))


__all__ = ["GiB", "GB", "CalibratedDevice", "CalibrationError", "CalibrationMismatchError", "DeviceModel", "DEVICES", "UnknownDeviceError", "get_device", "preset_for_gpu", "HostBudget",
           "DEFAULT_PINNED_LIMIT_BYTES", "PINNED_LIMIT_ENV", "host_usable_bytes", "pinned_limit_bytes",
           "pinned_limit_to_set", "usable_gpu_bytes", "graph_identity"]
