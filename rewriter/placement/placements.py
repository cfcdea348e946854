"""Where swap ops run and how the accelerator-side peak is measured: a real GPU or the CPU testbed.

One small interface (``Placement``), two implementations:

* ``GpuPlacement``: accelerator ``/device:GPU:0``, host ``/device:CPU:0``. The swap op is
  ``Identity``: placed on the other device, the executor's cross-device copy *is* the transfer.
  The peak is replayed from the profiler's trace of the GPU's allocator in requested bytes (the
  prediction's unit), beside TensorFlow's own ``get_memory_info('GPU:0')['peak']``.
* ``CpuTestbedPlacement``: no GPU (docs/design.md 4). ``/device:CPU:0`` plays the accelerator and
  ``/device:CPU:1`` the host; the swap op is ``DeepCopy`` because ``Identity`` between two logical
  CPUs shares the buffer; the swap-out copies on ``CPU:0`` and hands the copy over
  (``CpuTestbedPlacement.swap_out_device``). Both logical CPUs share one allocator, so the peak
  comes from replaying the profiler's memory trace and leaving out the allocations made by swap-out
  ops (``rewriter.placement.memtrace``). When TensorFlow was initialised with one CPU device before the testbed
  could be configured (the user built the model first), the single-device variant puts the host
  side on ``CPU:0`` too: the copies are still separate buffers, told apart by the swap-out op names.

``detect()`` chooses: a visible GPU, else the testbed (configured with two logical CPUs when that
is still possible), with a warning when the machine has a GPU TensorFlow does not see (a CPU-only
TensorFlow: ``scripts/setup --gpu`` installs the GPU build into its own environment).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import tensorflow as tf

from rewriter.placement import memtrace
from simulator.device.presets import get_device, preset_for_gpu
from simulator.device.memory_budgets import usable_gpu_bytes

log = logging.getLogger(__name__)

SWAP_OUT_PREFIX = "swap_out/"
SWAP_IN_PREFIX = "swap_in/"
BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


@dataclass(frozen=True)
class PeakReading:
    """Memory of one measured call. ``peak_bytes`` is in requested bytes where the measurement
    can tell (testbed), else the allocator's figure; ``None`` where a figure is not available."""

    peak_bytes: int
    allocator_peak_bytes: int
    host_peak_bytes: int | None
    resident_bytes: int


def is_swap_out_op(name: str) -> bool:
    """True for the swap-out nodes ``rewriter.step.apply_plan`` adds (and their profiler ``tf_op`` names)."""
    return name.startswith(SWAP_OUT_PREFIX)


@dataclass(frozen=True)
class Placement:
    """Devices of the swap ops and how one call's accelerator-side peak is measured."""

    accelerator: str
    host: str
    swap_op: str
    measured_on: str  # "gpu" or "cpu-testbed" (Measurement.measured_on)

    @property
    def simulator_device(self) -> str | None:
        """The ``simulator.device.presets`` preset that models this placement, if any."""
        return None

    @property
    def kept_reads(self) -> tuple[tuple[str, str], ...]:
        """(producer type, consumer type) reads a plan cannot move to a swap-in here: those of the
        device model of this placement (``simulator_device``; ``DeviceModel.kept_reads``)."""
        name = self.simulator_device
        return () if name is None else get_device(name).kept_reads

    @property
    def copies_wait_for_compute(self) -> bool:
        """Whether a copy out waits for a free compute thread (no copy engine of its own): left to
        the executor, such a copy can run hundreds of ops after its producer (``rewriter.edit.graph_edit``
        then makes the op after the producer wait for it)."""
        return False

    @property
    def allocator_prefix(self) -> str | None:
        """The profiler's name (prefix, upper case) of the accelerator's own allocator, where it has one
        apart from the host's (a GPU's "GPU_0_bfc"); None where the devices share one (the testbed)."""
        return None

    def is_host_op(self, op_name: str) -> bool:
        return is_swap_out_op(op_name)

    def on_host_device(self, device: str) -> bool:
        """Whether a variable placed on ``device`` (its full name) lives on the host side, apart from the
        accelerator (never on the single-device testbed, where the two are one device)."""
        if not device or self.host == self.accelerator:
            return False
        spec, host = tf.DeviceSpec.from_string(device), tf.DeviceSpec.from_string(self.host)
        return (spec.device_type, spec.device_index) == (host.device_type, host.device_index)

    def measure_peak(self, fn: Callable[..., Any], *args: Any, resident_bytes: int | None = None,
                     host_ops: frozenset[str] = frozenset()) -> PeakReading:
        """Peak of one call of ``fn``. ``resident_bytes``: what the step itself keeps on the device
        between calls (weights, optimizer state, inputs), where the measurement cannot tell it
        apart from the rest of the process (the CPU testbed). ``host_ops``: ops placed on the host
        beside the swap-outs (a variable's update beside its slots), whose allocations are the host's."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.measured_on}: accelerator {self.accelerator}, host {self.host}, swap op {self.swap_op}"

    @property
    def swap_out_device(self) -> str:
        """The device the swap-out node runs on: the host's, so the executor's cross-device copy to it
        is the transfer (a GPU's device-to-host copy)."""
        return self.host


@dataclass(frozen=True)
class GpuPlacement(Placement):
    """A real GPU. Uses only TF's documented memory APIs (``get_memory_info``, ``reset_memory_stats``)."""

    accelerator: str = "/device:GPU:0"
    host: str = "/device:CPU:0"
    swap_op: str = "Identity"
    measured_on: str = "gpu"

    @property
    def allocator_prefix(self) -> str:
        return f"GPU_{self.accelerator.rsplit(':', 1)[-1]}_"

    @property
    def simulator_device(self) -> str | None:
        found = gpu_memory()
        if found is None:
            return None
        return preset_for_gpu(found[0])

    def measure_peak(self, fn: Callable[..., Any], *args: Any, resident_bytes: int | None = None,
                     host_ops: frozenset[str] = frozenset()) -> PeakReading:
        """One profiled call: ``peak_bytes`` in requested bytes from the profiler's trace of the GPU's
        allocator (the prediction's unit, as on the testbed), ``allocator_peak_bytes`` TensorFlow's own
        ``get_memory_info`` peak (BFC chunks, cuDNN workspaces included) of the same call; host copies
        (the pinned ``gpu_host_bfc`` allocator) are left out by allocator, and counted as the host peak."""
        device = self.accelerator.rsplit("device:", 1)[-1]  # "GPU:0"
        tf.config.experimental.reset_memory_stats(device)
        current = int(tf.config.experimental.get_memory_info(device)["current"])

        def call(*inputs: Any) -> Any:  # GPU kernels run asynchronously: wait for the outputs in the trace
            result = fn(*inputs)
            _block(result)
            return result

        events = memtrace.record_memory_events(call, *args)
        allocator_peak = int(tf.config.experimental.get_memory_info(device)["peak"])
        return gpu_reading(events, device, allocator_peak_bytes=allocator_peak, current_bytes=current,
                           resident_bytes=resident_bytes, allocator_prefix=self.allocator_prefix)


@dataclass(frozen=True)
class CpuTestbedPlacement(Placement):
    """The CPU testbed: ``CPU:0`` accelerator, ``CPU:1`` host (or ``CPU:0`` when only one exists)."""

    accelerator: str = "/device:CPU:0"
    host: str = "/device:CPU:1"
    swap_op: str = "DeepCopy"
    measured_on: str = "cpu-testbed"

    @property
    def copies_wait_for_compute(self) -> bool:
        """The testbed's copies are ``DeepCopy`` kernels the executor queues on the same threads as the
        step, behind the chain of ops it runs inline."""
        return True

    @property
    def single_device(self) -> bool:
        return self.host == self.accelerator

    @property
    def simulator_device(self) -> str | None:
        return "cpu-testbed"

    @property
    def swap_out_device(self) -> str:
        """The accelerator's: the ``DeepCopy`` reads the tensor on its own device and only the copy goes
        to the host (its bytes are told apart by the swap-out's name). Read across the two logical CPUs,
        the tensor's buffer was still referenced by the cross-device send/receive after the swap-out had
        run and its readers had been released, and let go of on whichever thread handled the transfer:
        under load up to 2 ms later, so the next reader could not reuse the buffer in place and it
        outlived its readers, in some runs past the step's peak (norm_mix_24: +288 KiB, a measured peak
        16 % above the prediction in about 1 run of 10)."""
        return self.accelerator

    def measure_peak(self, fn: Callable[..., Any], *args: Any, resident_bytes: int | None = None,
                     host_ops: frozenset[str] = frozenset()) -> PeakReading:
        warn_if_allocations_hidden()
        warn_if_onednn_off()

        def is_host_op(name: str) -> bool:
            return self.is_host_op(name) or (not self.single_device and name in host_ops)

        if resident_bytes is None:
            peak = memtrace.measure_call_peak(fn, *args, is_host_op=is_host_op, device="CPU:0")
        else:
            # the CPU allocator also holds what other functions of the process left behind (the
            # constants TF materialised while optimising them): count only the step's own state. With
            # state on the host, the call before is traced too: the host buffers it kept are freed in this one
            host_state = bool(host_ops) and not self.single_device
            events = memtrace.record_memory_events(fn, *args, calls=2 if host_state else 1)
            measured = events[events["call"] == events["call"].max()]
            peak = memtrace.accelerator_peak(measured, is_host_op=is_host_op, resident_bytes=resident_bytes,
                                             resident_unit="requested",
                                             previous=events[events["call"] < events["call"].max()] if host_state else None)
        return PeakReading(peak_bytes=int(peak.peak_requested_bytes), allocator_peak_bytes=int(peak.peak_allocated_bytes),
                           host_peak_bytes=int(peak.host_peak_requested_bytes), resident_bytes=int(peak.resident_bytes))

    def describe(self) -> str:
        text = super().describe()
        return text + (" (single-device testbed: host copies told apart by op name)" if self.single_device else "")


def gpu_reading(events, device: str, *, allocator_peak_bytes: int, current_bytes: int,
                resident_bytes: int | None = None, allocator_prefix: str | None = None) -> PeakReading:
    """A GPU call's ``PeakReading`` from its profiler memory events (``memtrace.parse_xspace``): the
    allocator named after the device ("GPU_0_bfc") is the device, "gpu_host_bfc" the host copies. When
    the trace holds no event of the device's allocator, the allocator's figure is all there is."""
    prefix = allocator_prefix or f"GPU_{device.rsplit(':', 1)[-1]}_"
    names = {str(name) for name in events["allocator_name"].unique()} if len(events) else set()
    ours = sorted(name for name in names if name.upper().startswith(prefix))
    if not ours:
        log.warning("the profiler recorded no allocation of %s's allocator: the peak is TensorFlow's allocator "
                    "figure (chunk bytes), not requested bytes", device)
        return PeakReading(peak_bytes=allocator_peak_bytes, allocator_peak_bytes=allocator_peak_bytes,
                           host_peak_bytes=None, resident_bytes=current_bytes)
    resident = current_bytes if resident_bytes is None else int(resident_bytes)
    unit = "chunks" if resident_bytes is None else "requested"
    peak = memtrace.accelerator_peak(events, is_host_op=lambda name: False, resident_bytes=resident,
                                     resident_unit=unit, allocator=ours[0])
    host = events[events["allocator_name"] == "gpu_host_bfc"]
    host_peak = memtrace.accelerator_peak(host, is_host_op=lambda name: False).peak_requested_bytes if len(host) else 0
    return PeakReading(peak_bytes=int(peak.peak_requested_bytes), allocator_peak_bytes=int(allocator_peak_bytes),
                       host_peak_bytes=int(host_peak), resident_bytes=resident)


def _block(result: Any) -> None:
    """Wait for the call's outputs (eager results are ready when returned; numpy() forces it)."""
    for tensor in tf.nest.flatten(result):
        if hasattr(tensor, "numpy"):
            tensor.numpy()


_warned_bfc = False
_warned_onednn = False


def warn_if_allocations_hidden() -> bool:
    """Warn (once) when the CPU allocator may hide small allocations (docs/design.md 4); True if so."""
    global _warned_bfc
    value = os.environ.get(BFC_ENV, "").strip().lower()
    hidden = value not in ("true", "1")
    if hidden and not _warned_bfc:
        _warned_bfc = True
        log.warning("%s=true was not set before TensorFlow started: the CPU allocator does not report "
                    "allocations under 256 KiB, so measured peaks are too low. Set it in the environment "
                    "before importing TensorFlow.", BFC_ENV)
    return hidden


def onednn_enabled() -> bool | None:
    """Whether TensorFlow runs its oneDNN CPU kernels (fixed when it was imported); None if unknown."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # an internal module: a TF build without it cannot tell
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def warn_if_onednn_off() -> bool:
    """Warn (once) when the testbed runs without oneDNN's CPU kernels (``rewriter.environment``); True if so."""
    global _warned_onednn
    off = onednn_enabled() is False
    if off and not _warned_onednn:
        _warned_onednn = True
        log.warning("TensorFlow runs without its oneDNN CPU kernels (TF_ENABLE_ONEDNN_OPTS=1 was not set before "
                    "it was imported, and this CPU does not turn them on by default): convolution gradients "
                    "then hold large temporary buffers the cpu-testbed model does not count, so measured "
                    "peaks are higher than predicted. Import rewriter first, or set TF_ENABLE_ONEDNN_OPTS=1.")
    return off


def limit_device_memory(budget_bytes: int, gpus: int = 1) -> bool:
    """Make ``budget_bytes`` the memory limit of each of the first ``gpus`` GPUs (a logical device of that size
    on each: the replicas of ``--replicas N`` are held to the budget per device). Only possible before
    TensorFlow's runtime starts, i.e. before the model is loaded; returns whether it is in effect."""
    visible = tf.config.list_physical_devices("GPU")[:gpus]
    if not visible:
        return False
    limit_mib = max(1, int(budget_bytes) // 2**20)
    for gpu in visible:
        current = tf.config.get_logical_device_configuration(gpu)
        if current and getattr(current[0], "memory_limit", None) == limit_mib:
            continue
        try:
            limited = [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)]
            tf.config.set_logical_device_configuration(gpu, limited)
        except RuntimeError:  # "Virtual devices cannot be modified after being initialized"
            log.warning("TensorFlow's runtime had started before the budget of %.2f GiB could be set as the memory "
                        "limit of %s: the measured run may use more than the budget and cannot show that a plan does "
                        "not fit", budget_bytes / 2**30, gpu.name.replace("/physical_device:", ""))
            return False
    return True


def configure_testbed(n_devices: int = 2, *, gpu_memory_limit_bytes: int | None = None) -> bool:
    """Split the CPU into ``n_devices`` logical devices (CPU:0 accelerator, CPU:1 host).

    Only possible before TensorFlow's runtime is initialised (before any op or model is built);
    returns whether the split is in effect. When a GPU is visible it splits nothing and, given
    ``gpu_memory_limit_bytes`` (the budget), makes that GPU:0's memory limit (``limit_device_memory``).
    """
    if tf.config.list_physical_devices("GPU"):
        if gpu_memory_limit_bytes:
            limit_device_memory(gpu_memory_limit_bytes)
        return False
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) >= n_devices:
        return True
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n_devices)
    except RuntimeError:  # "Virtual devices cannot be modified after being initialized"
        log.info("TensorFlow is already initialised with %d CPU device(s): using the single-device testbed",
                 len(tf.config.list_logical_devices("CPU")))
        return False
    threads = tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count() or 1
    if n_devices > 2 and threads < 2 * n_devices:
        # several replicas: two threads per logical device. With fewer, each replica's chained ops run inline on
        # the threads and its copies out queue behind them until an op waits for one (docs/design.md 14)
        tf.config.threading.set_inter_op_parallelism_threads(2 * n_devices)
    return True


def detect(*, configure: bool = True) -> Placement:
    """The placement for this process: a visible GPU, else the CPU testbed.

    With ``configure`` (default) the testbed's second logical CPU is created when TensorFlow is not
    initialised yet; otherwise (or when that is too late) the single-device testbed is used.
    """
    if tf.config.list_physical_devices("GPU"):
        return GpuPlacement()
    warn_if_gpu_without_cuda()
    if configure:
        configure_testbed()
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    if "/device:CPU:1" in names:
        return CpuTestbedPlacement()
    return CpuTestbedPlacement(host="/device:CPU:0")


def _nvidia_smi(*query: str) -> list[list[str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        result = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if result.returncode != 0:
        return []
    return [[part.strip() for part in line.split(",")] for line in result.stdout.splitlines() if line.strip()]


def parse_gpu_memory(rows: list[list[str]], name: str) -> int | None:
    """Total memory (bytes) of the GPUs called ``name`` in ``nvidia-smi --query-gpu=name,memory.total``
    rows (MiB); the least where several differ; None when none matches."""
    wanted = name.strip().lower()
    sizes = []
    for row in rows:
        if len(row) >= 2 and row[0].lower() == wanted:
            try:
                sizes.append(int(float(row[1])) * 2**20)
            except ValueError:
                continue
    return min(sizes) if sizes else None


def reported_gpu_memory(name: str) -> int | None:
    """The total memory the driver reports for the GPU called ``name``; None when it cannot be read."""
    return parse_gpu_memory(_nvidia_smi("--query-gpu=name,memory.total", "--format=csv,noheader,nounits"), name)


def gpu_present() -> bool:
    """A GPU on this machine, whatever TensorFlow sees (the NVIDIA driver's device list)."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (nvidia.is_dir() and any(nvidia.iterdir())) or bool(_nvidia_smi("-L"))


_checked_gpu: list[bool] = []  # the answer of warn_if_gpu_without_cuda, once per process


def warn_if_gpu_without_cuda() -> bool:
    """Warn (once) when the machine has a GPU that TensorFlow does not see; True if so."""
    if _checked_gpu:
        return _checked_gpu[0]
    _checked_gpu.append(False)
    if tf.config.list_physical_devices("GPU") or not gpu_present():
        return False
    _checked_gpu[0] = True
    if not tf.test.is_built_with_cuda():
        log.warning("this machine has a GPU, but the installed TensorFlow was built without CUDA (tensorflow-cpu): "
                    "everything runs on the CPU testbed. Install the GPU build: scripts/setup --gpu")
    else:
        log.warning("this machine has a GPU, but TensorFlow sees none (CUDA libraries or driver missing, or "
                    "CUDA_VISIBLE_DEVICES hides it): everything runs on the CPU testbed")
    return True


def gpu_memory() -> tuple[str, int] | None:
    """(name, bytes TensorFlow may use) of GPU:0, or None without a GPU.

    The bytes are the ``memory_limit`` of GPU:0's logical device configuration when one is set,
    otherwise the usable budget of the ``simulator.device.presets`` preset matching the GPU's name, otherwise
    (a GPU without a preset) the usable part of the total memory the driver reports
    (``simulator.device.memory_budgets.usable_gpu_bytes``; TF has no documented API for a GPU's total memory);
    0 when none of them is known.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0]) or {}
    name = str(details.get("device_name", gpus[0].name))
    configs = tf.config.get_logical_device_configuration(gpus[0]) or []
    limit = getattr(configs[0], "memory_limit", None) if configs else None
    if limit:
        return name, int(limit) * 2**20
    preset = preset_for_gpu(name)
    if preset is not None:
        return name, int(get_device(preset).budget_bytes)
    total = reported_gpu_memory(name)
    major = (details.get("compute_capability") or (None,))[0]
    return name, 0 if total is None else usable_gpu_bytes(total, major)


def resolve(placement: Placement | str | None) -> Placement:
    """``None``/"auto" -> ``detect()``; "gpu", "cpu-testbed", "cpu-testbed-1" by name; or as given."""
    if placement is None or placement == "auto":
        return detect()
    if isinstance(placement, Placement):
        return placement
    if placement == "gpu":
        return GpuPlacement()
    if placement == "cpu-testbed":
        return CpuTestbedPlacement()
    if placement in ("cpu-testbed-1", "cpu-testbed-single"):
        return CpuTestbedPlacement(host="/device:CPU:0")
    raise ValueError(f"unknown placement {placement!r}: use 'auto', 'gpu', 'cpu-testbed' or 'cpu-testbed-1'")
