"""Memory budgets beside a GPU: the host RAM swapped tensors may fill (TensorFlow's pinned host
allocator and its limit), and the GPU memory TensorFlow can use on a GPU without a preset.

Pure arithmetic on figures the rewriter reads from the machine (``rewriter.host_memory``,
``rewriter.placement.placements``); the presets themselves are in ``simulator.device.presets``.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.device.presets import GiB

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


__all__ = ["DEFAULT_PINNED_LIMIT_BYTES", "PINNED_LIMIT_ENV", "HostBudget", "host_usable_bytes", "pinned_limit_bytes",
           "pinned_limit_to_set", "usable_gpu_bytes"]
