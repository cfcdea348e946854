"""Device presets: every figure present and cited, and TensorFlow's GPU names mapped to them."""

from __future__ import annotations

import pytest

from simulator import DEVICES
from simulator.device.presets import preset_for_gpu


def test_every_preset_is_complete_and_cited():
    for name, device in DEVICES.items():
        assert device.name == name and device.source.strip()
        assert 0 < device.budget_bytes <= device.capacity_bytes


@pytest.mark.parametrize("gpu_name, preset", [
    ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"),
    ("NVIDIA H200", "h200-141gb"),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_names_map_to_presets(gpu_name, preset):
    assert preset_for_gpu(gpu_name) == preset
