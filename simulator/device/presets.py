"""Accelerator presets for the swap simulator.

Why this module exists
----------------------
The simulator predicts the peak device memory and the step time of one training
step, with and without activations swapped out to host memory, so that the
auto-tuner can search swap plans quickly and without the hardware.  It is
deliberately framework-free: it never imports TensorFlow (numpy, pandas and numba
only), so it can run on a laptop, in CI, or on the head node of a cluster.
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

from dataclasses import dataclass

import numpy as np

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
    # compute's cores (the CPU testbed: fitted by rewriter.timing.device_calibration); 0 for a GPU's copy engines. A copy
    # the step waits for (a stall) runs alone and costs nothing more
    copy_contention: float = 0.0
    # seconds each copy (swap-out or swap-in) adds to the step beyond its transfer: the executor's
    # cross-device hand-off on the compute's threads (the CPU testbed: fitted by rewriter.timing.device_calibration)
    copy_overhead_s: float = 0.0
    # whether the op after a swapped tensor's producer waits for its copy out, as on the CPU testbed, whose
    # copies wait for a compute thread and whose op after the producer is made to wait for the copy
    # (rewriter.edit.graph_edit, Placement.copies_wait_for_compute): the replay then waits for every copy out at
    # the op after its producer (past a fused chain), starts it when that op is due, and has each swap-in wait
    # for the copies out of what its trigger made (after_copies_out, as that placement's rewrite does). The
    # cpu-testbed preset sets it, and rewriter.timing.device_calibration on such a placement
    copies_out_wait: bool = False
    # whether a tensor the host hands to the device keeps its host buffer (the CPU testbed's two logical CPUs
    # share one memory: the send/receive passes the buffer on): the change a host update sends to a weight's
    # write then takes no device memory (simulator.state.with_host_state); a GPU copies it in
    host_buffers_shared: bool = False
    # how fast the host's CPU applies an update the plan moved there (simulator.state.host_update.host_cpu_seconds):
    # bytes of weight, gradient and optimizer slots per second, and a fixed cost per variable (its ops'
    # dispatch). 0: the update's ops keep the op times the graph has (the CPU testbed, whose host shares the
    # compute's cores: a calibration times the update as part of the step)
    host_update_bytes_per_s: float = 0.0
    host_update_variable_s: float = 0.0

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
        for field in ("transfer_latency_s", "op_overhead_s", "copy_contention", "copy_overhead_s",
                      "host_update_bytes_per_s", "host_update_variable_s"):
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
        Accepts Python/numpy scalars (returns a float, the search's fast path) or
        array-likes (returns a numpy array).
        """
        if _is_scalar(flops) and _is_scalar(touched_bytes):
            compute = flops / self.effective_flops
            memory = touched_bytes / self.effective_bandwidth
            return (compute if compute > memory else memory) + self.op_overhead_s
        compute = np.asarray(flops, dtype=np.float64) / self.effective_flops
        memory = np.asarray(touched_bytes, dtype=np.float64) / self.effective_bandwidth
        return np.maximum(compute, memory) + self.op_overhead_s

    def host_update_s(self, variables: int, state_bytes: float) -> float:
        """Seconds the host's CPU takes to update ``variables`` variables holding ``state_bytes`` of weights,
        gradients and slots (0 where the update keeps the graph's op times: ``host_update_bytes_per_s`` 0)."""
        if not self.host_update_bytes_per_s > 0:
            return 0.0
        return variables * self.host_update_variable_s + state_bytes / self.host_update_bytes_per_s

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
        return self.transfer_latency_s + np.asarray(nbytes, dtype=np.float64) / bw


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
#  - host_update_bytes_per_s = 4.5e9, host_update_variable_s = 23e-6: measured, and a conservative stand-in for a
#    GPU server's host -- Keras 3.15's AdamW update on 2 cores of the development VM (rewriter.timing.
#    measure_host_update: 96 variables of 256 parameters and 2 of 16M, 4.49 GB/s of weights, gradients and
#    slots and 22.8 us per variable; SGD with momentum 10.2 GB/s, Adam 5.2). A server's host has more cores
#    and memory channels, so a preset's host update is an upper bound; beside a visible GPU the calibration
#    measures the machine's own host with the model's own optimizer (autotune.run.calibrated_timing).
_GPU_LATENCY_S = 10e-6
_GPU_OP_OVERHEAD_S = 5e-6
_GPU_COMPUTE_EFF = 0.6
_GPU_BW_EFF = 0.8
_HOST_UPDATE_BYTES_PER_S = 4.5 * GB
_HOST_UPDATE_VARIABLE_S = 23e-6

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
    host_update_bytes_per_s=_HOST_UPDATE_BYTES_PER_S,  # measured, conservative: see _HOST_UPDATE_BYTES_PER_S
    host_update_variable_s=_HOST_UPDATE_VARIABLE_S,  # measured, see above
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
    host_update_bytes_per_s=_HOST_UPDATE_BYTES_PER_S,  # measured, conservative: see _HOST_UPDATE_BYTES_PER_S
    host_update_variable_s=_HOST_UPDATE_VARIABLE_S,  # measured, see above
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
    host_update_bytes_per_s=_HOST_UPDATE_BYTES_PER_S,  # measured, conservative: see _HOST_UPDATE_BYTES_PER_S
    host_update_variable_s=_HOST_UPDATE_VARIABLE_S,  # measured, see above
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
    host_update_bytes_per_s=_HOST_UPDATE_BYTES_PER_S,  # measured, conservative: see _HOST_UPDATE_BYTES_PER_S
    host_update_variable_s=_HOST_UPDATE_VARIABLE_S,  # measured, see above
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
    host_update_bytes_per_s=_HOST_UPDATE_BYTES_PER_S,  # measured, conservative: see _HOST_UPDATE_BYTES_PER_S
    host_update_variable_s=_HOST_UPDATE_VARIABLE_S,  # measured, see above
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
    host_update_bytes_per_s=_HOST_UPDATE_BYTES_PER_S,  # measured, conservative: see _HOST_UPDATE_BYTES_PER_S
    host_update_variable_s=_HOST_UPDATE_VARIABLE_S,  # measured, see above
    source=f"{_H200_DS}; {_PCIE5_MEAS}; {_TF_RESERVE}; 8-GPU H200 node: 2 TB RAM (MLPerf v4.1 NVIDIA system)",
)

# -----------------------------------------------------------------------------
# cpu-testbed: the development VM (2-core AMD EPYC "Genoa" -- family 25 model 17 -- KVM guest,
# 24 GiB RAM).  Two logical TF CPU devices play accelerator (/CPU:0) and host (/CPU:1); a swap
# is a tf.raw_ops.DeepCopy between them.  The compute, bandwidth and copy figures are a roofline of
# microbenchmarks, measured on 2026-11-30 (TF 2.21, fp32, graph mode,
# TF_CPU_ALLOCATOR_USE_BFC=true as in the testbed; each figure the median over 6 runs in which other
# processes used < 1 % of the CPU) by the measurements rewriter.timing.device_calibration.measure_preset now makes in
# the repository (matmul, elementwise add, tiny-op chain, chained copies).  Re-measured with it on
# 2026-12-02 with other jobs busy on both cores: matmul 444 GFLOP/s, elementwise
# 17.9 GB/s, 0.41 us per tiny op, copies of 64-256 MiB 19.4 GB/s, 1.8 us per small copy: the machine's
# figures move with its load, so the ones below are kept as an estimate of the quiet machine.
# STEP TIMES from this roofline are a datasheet-style estimate: against measured steps on the testbed
# (python -m benchmarks step-time, 4 models x 7 plans, six runs) they were off by median 9-55 %, worst 49-88 %;
# rewriter.timing.device_calibration (autotune --calibrate, the default for a measured run) replaces them with the
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
    host_buffers_shared=True,
    # the testbed's placement makes the op after a producer wait for its copy out (Placement.copies_wait_for_compute)
    copies_out_wait=True,
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
    source=("roofline of microbenchmarks on this VM (rewriter.timing.device_calibration.measure_preset: TF 2.21, 2-core AMD EPYC KVM "
            "guest, TF_CPU_ALLOCATOR_USE_BFC=true), 2026-11-30, median of 6 uncontended runs; an estimate of the "
            "quiet machine only; step times: calibrate the model (rewriter.timing.device_calibration) for measured ones"),
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


__all__ = ["GiB", "GB", "DeviceModel", "DEVICES", "UnknownDeviceError", "get_device", "preset_for_gpu"]
