"""Pinned host memory beside a GPU: the limit TensorFlow enforces, and raising it before it starts.

Copies out of a GPU land in TensorFlow's pinned host allocator, limited by
``TF_GPU_HOST_MEM_LIMIT_IN_MB`` (default 128 GiB; ``simulator.device.memory_budgets`` has the source). TensorFlow
reads it once, when that allocator is first needed, long before a plan exists: so
``prepare_environment()`` (``import rewriter``, the CLI, tests, benchmarks) raises it, when it is
unset, to this machine's RAM less a margin, which is what any plan may need at most. The allocator
grows on demand, so a higher limit pins nothing by itself. A value the user set is left as it is and
the host budget follows it (``host_budget``), with a sentence saying how to raise it.

Imports nothing of TensorFlow.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

from simulator.device.memory_budgets import (PINNED_LIMIT_ENV, HostBudget, host_usable_bytes, pinned_limit_bytes,
                                      pinned_limit_to_set)

log = logging.getLogger(__name__)

_raised: dict[str, object] = {}  # what raise_pinned_limit set in this process: value, before_tensorflow


def physical_memory_bytes() -> int:
    """This machine's RAM (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def raise_pinned_limit(environ: MutableMapping[str, str] | None = None, physical_bytes: int | None = None) -> str | None:
    """Set TF_GPU_HOST_MEM_LIMIT_IN_MB to the machine's usable RAM when it is unset and the default is
    lower; returns the value set (None: left as it was). Without effect on a TensorFlow process whose
    GPU runtime already started, and on CPU-only TensorFlow."""
    env = os.environ if environ is None else environ
    value = pinned_limit_to_set(env.get(PINNED_LIMIT_ENV), physical_memory_bytes() if physical_bytes is None
                                else physical_bytes)
    if value is not None:
        env[PINNED_LIMIT_ENV] = value
        if environ is None:
            _raised.update(value=value, before_tensorflow="tensorflow" not in sys.modules)
    return value


def pinned_limit_source(environ: MutableMapping[str, str] | None = None) -> str:
    """"default" (unset), "raised" (by ``raise_pinned_limit`` before TensorFlow was imported), "raised
    late" (after: in force only if TensorFlow's GPU runtime had not started) or "environment" (the user's)."""
    env = os.environ if environ is None else environ
    value = env.get(PINNED_LIMIT_ENV)
    if value is None or not value.strip():
        return "default"
    if environ is None and _raised.get("value") == value:
        return "raised" if _raised.get("before_tensorflow") else "raised late"
    return "environment"


def host_budget(preset_bytes: int, *, environ: MutableMapping[str, str] | None = None,
                physical_bytes: int | None = None) -> HostBudget:
    """The host memory a plan may fill beside a GPU of this machine (``simulator.device.memory_budgets.HostBudget``)."""
    env = os.environ if environ is None else environ
    physical = physical_memory_bytes() if physical_bytes is None else int(physical_bytes)
    usable = host_usable_bytes(physical) if physical else int(preset_bytes)
    return HostBudget(preset_bytes=int(preset_bytes), pinned_limit_bytes=pinned_limit_bytes(env.get(PINNED_LIMIT_ENV)),
                      usable_bytes=usable, pinned_limit_source=pinned_limit_source(environ))


def warn_if_pinned_limit_short(needed_bytes: int, environ: MutableMapping[str, str] | None = None) -> bool:
    """Warn when a step may hold more pinned host memory than TensorFlow's limit in force; True if so."""
    budget = host_budget(needed_bytes, environ=environ)
    if needed_bytes <= budget.pinned_limit_bytes:
        return False
    log.warning("this plan copies up to %.1f GiB to the host, more than TensorFlow's pinned host memory limit of "
                "%.1f GiB (%s): copies out past it fail with ResourceExhausted. %s", needed_bytes / 2**30,
                budget.pinned_limit_bytes / 2**30, PINNED_LIMIT_ENV,
                f"Set {PINNED_LIMIT_ENV}={needed_bytes // 2**20 + 1} before TensorFlow starts (this machine has "
                f"{budget.usable_bytes / 2**30:.1f} GiB to spare)." if needed_bytes < budget.usable_bytes else
                f"This machine has only {budget.usable_bytes / 2**30:.1f} GiB to spare: choose a plan that copies less.")
    return True
