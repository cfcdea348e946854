"""The device a plan is made for: its model, its budgets, and where each came from.

A ``Target`` is resolved once, by the CLI (before TensorFlow's runtime starts: a budget the user named
becomes a visible GPU's memory limit) or by ``autotune.tune``, and handed down to the search, the
measured run and the verdict, which never derive a budget again. The measured run may run on another
machine (the CPU testbed): it checks the simulator there, and the verdict carries that check to the
target's own prediction (``autotune.run.verdict``, docs/design.md section 6).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from autotune.inputs import InputError, format_bytes
from simulator import DeviceModel, get_device
from simulator.device.presets import preset_for_gpu

DEFAULT_DEVICE = "v100-16gb"


@dataclass(frozen=True)
class Target:
    """The device a plan is made for. ``device`` times the simulation and holds the host budget;
    ``device_budget_bytes`` is what a plan's peak must stay within; each ``*_source`` says where a
    figure came from ("--memory 12.00 GiB", "--device v100-16gb: the v100-16gb preset, 88% of its 16.00 GiB",
    "autotune.toml: memory 12.00 GiB", "the visible GPU ..."). ``limits_gpu``: the user named the budget,
    so a visible GPU is held to it (its memory limit) in the measured run."""

    device: DeviceModel
    device_budget_bytes: int
    device_budget_source: str
    host_budget_source: str
    timings_source: str
    limits_gpu: bool = False
    # replicas of one machine this target is one of (``per_replica``): each holds ``host_budget_bytes``, the
    # machine ``machine_host_budget_bytes`` (every replica's swaps share it)
    replicas: int = 1
    machine_host_budget_bytes: int | None = None

    @property
    def host_budget_bytes(self) -> int:
        return int(self.device.host_memory_bytes)

    def per_replica(self, replicas: int) -> Target:
        """This target for one of ``replicas`` replicas on one machine: the same device budget, 1/N of the host's."""
        host = self.host_budget_bytes // replicas
        return replace(self, device=replace(self.device, host_memory_bytes=host), replicas=replicas,
                       machine_host_budget_bytes=self.host_budget_bytes,
                       host_budget_source=f"{self.host_budget_source}, " + (
                           "one replica on the machine" if replicas == 1
                           else f"shared by {replicas} replicas: {format_bytes(host)} each"))

    @property
    def budget_source(self) -> str:
        """One sentence: where the budgets and the timings come from (the CLI's and the report's)."""
        return f"{self.device_budget_source} ({self.timings_source}); host: {self.host_budget_source}"

    def with_timings(self, timed: DeviceModel) -> Target:
        """The same budgets, the simulation timed by ``timed`` (a calibration of this device measured on
        this machine, ``autotune.run.calibrated_timing``), with this target's host budget."""
        return replace(self, device=replace(timed, host_memory_bytes=self.host_budget_bytes),
                       timings_source=f"timings measured on this machine: {timed.name}")

    def to_dict(self) -> dict:
        """summary.json's ``target``."""
        return {"device": self.device.name, "device_budget_bytes": self.device_budget_bytes,
                "device_budget_source": self.device_budget_source, "host_budget_bytes": self.host_budget_bytes,
                "host_budget_source": self.host_budget_source, "timings_source": self.timings_source,
                **({} if self.replicas == 1 else {"replicas": self.replicas,
                                                  "machine_host_budget_bytes": self.machine_host_budget_bytes})}


def _preset_budget(model: DeviceModel) -> str:
    return (f"the {model.name} preset, {model.usable_fraction:.0%} of its {format_bytes(model.capacity_bytes)} "
            f"({format_bytes(model.budget_bytes)} usable)")


def resolve_target(device: str | DeviceModel | None = None, memory: int | None = None, *,
                   memory_from: str = "--memory", device_from: str = "--device") -> Target:
    """The target of a run: the budget from ``memory`` (named by ``memory_from``: "--memory",
    "autotune.toml: memory", ...), else ``device``'s preset, else the visible GPU, else the
    ``DEFAULT_DEVICE`` preset; timings from ``device``'s preset (the GPU's, or the default's).

    Beside a visible GPU the host RAM for copies is the least of the preset's, TensorFlow's pinned-memory
    limit in force and this machine's RAM less a margin (``rewriter.host_memory.host_budget``)."""
    if isinstance(device, DeviceModel):
        model, named = device, "given"
    elif device:
        try:
            model, named = get_device(device), device_from
        except (KeyError, ValueError) as error:
            raise InputError(str(error).strip("'\"")) from None
    else:
        model, named = None, ""
    gpu = _visible_gpu()
    if memory is not None:
        model = model or get_device(DEFAULT_DEVICE)
        model, host = _with_host_budget(model, gpu)
        return Target(model, int(memory), f"{memory_from} {format_bytes(memory)}", host,
                      f"timings from the {model.name} preset", limits_gpu=True)
    if model is not None:
        model, host = _with_host_budget(model, gpu)
        where = f"{named} {model.name}: " if named not in ("", "given") else ""
        return Target(model, model.budget_bytes, where + _preset_budget(model), host,
                      f"timings from the {model.name} preset", limits_gpu=True)
    if gpu is not None:
        name, limit, _ = gpu
        known = preset_for_gpu(name)
        if limit <= 0:
            raise InputError(f"the visible GPU {name} has no preset and its memory could not be read (nvidia-smi): "
                             "give the budget with --memory (and timings with --device)")
        preset, host = _with_host_budget(get_device(known or DEFAULT_DEVICE), gpu)
        timings = f"timings from the {preset.name} preset" + ("" if known else ": no preset for it")
        return Target(preset, int(limit), f"the visible GPU {name} ({format_bytes(limit)} available to TensorFlow)",
                      host, timings)
    preset = get_device(DEFAULT_DEVICE)
    return Target(preset, preset.budget_bytes, f"no GPU visible and no budget given: {_preset_budget(preset)}",
                  f"the {preset.name} preset's {format_bytes(preset.host_memory_bytes)}",
                  f"timings from the {preset.name} preset")


def resolve_device(device: str | DeviceModel | None, memory: int | None) -> tuple[DeviceModel, int, str]:
    """(device model, budget, where they came from): ``resolve_target`` as a tuple."""
    target = resolve_target(device, memory)
    return target.device, target.device_budget_bytes, target.budget_source


def _with_host_budget(model: DeviceModel, gpu) -> tuple[DeviceModel, str]:
    """``model`` with the host budget of the visible GPU's machine, and a sentence saying it (the
    preset's own without a GPU)."""
    if gpu is None:
        return model, f"the {model.name} preset's {format_bytes(model.host_memory_bytes)}"
    budget = gpu[2](model.host_memory_bytes)
    return replace(model, host_memory_bytes=budget.bytes), budget.describe()


def _visible_gpu():
    """(name, bytes TensorFlow may use, host budget for a preset's host bytes) of GPU:0, or None.
    Only asks TF when it is already imported."""
    if "tensorflow" not in sys.modules:
        return None
    import rewriter.host_memory as host_memory
    import rewriter.placement.placements as placement

    found = placement.gpu_memory()
    return None if found is None else (found[0], found[1], host_memory.host_budget)
