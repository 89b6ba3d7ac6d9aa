"""Vendor detection: hardware attributes of the torch build, and the simulation overrides."""

from __future__ import annotations

import types

import pytest

from bimetal.errors import UserError
from bimetal.topology import devices, vendor


def _fake_torch(cuda: str | None, hip: str | None) -> types.SimpleNamespace:
    version = types.SimpleNamespace(cuda=cuda, hip=hip)
    return types.SimpleNamespace(version=version, cuda=types.SimpleNamespace(is_available=lambda: True))


@pytest.mark.parametrize(
    ("cuda", "hip", "expected"),
    [("12.8", None, "nvidia"), (None, "6.4.1", "amd"), ("12.8", "6.4.1", "amd"), (None, None, "cpu")],
)
def test_hardware_vendor_from_build(cuda, hip, expected) -> None:
    # ROCm builds report device type "cuda" too, so hip must win over cuda.
    assert vendor.hardware_vendor(_fake_torch(cuda, hip)) == expected  # type: ignore[arg-type]


def test_this_build_is_cpu() -> None:
    assert vendor.hardware_vendor() == "cpu"


def test_parse_simulate_expands_in_rank_order() -> None:
    assert vendor.parse_simulate("nvidia:2,amd:3") == ["nvidia", "nvidia", "amd", "amd", "amd"]


@pytest.mark.parametrize("spec", ["", "nvidia", "nvidia:0", "intel:2", "nvidia:x", "amd:-1"])
def test_parse_simulate_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(UserError):
        vendor.parse_simulate(spec)


def test_simulate_env_overrides_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIMETAL_SIMULATE", "nvidia:1,amd:1")
    monkeypatch.delenv("BIMETAL_VENDOR", raising=False)
    assert vendor.detect_vendor(rank=0) == "nvidia"
    assert vendor.detect_vendor(rank=1) == "amd"
    monkeypatch.setenv("BIMETAL_VENDOR", "amd")
    assert vendor.detect_vendor(rank=0) == "amd"


def test_device_table_covers_both_vendors() -> None:
    names = {spec.name for spec in devices.DEVICE_TABLE}
    for part in ("A100", "H100", "H200", "B200", "MI250X", "MI300X", "MI325X", "MI355X"):
        assert any(part in name for name in names), part
    h100 = devices.lookup("NVIDIA H100 80GB HBM3")
    assert h100 is not None and h100.vendor == "nvidia" and h100.peak_bf16_flops > 5e14
    mi300 = devices.lookup("AMD Instinct MI300X")
    assert mi300 is not None and mi300.vendor == "amd"
    assert devices.lookup("Some Future GPU 9000") is None


def test_ranks_get_the_simulation_by_one_channel_and_it_is_parsed_once() -> None:
    from bimetal.simulate import _parse, parse_simulate, strip_simulate

    argv = ["--config", "c.toml", "--simulate", "nvidia:1,amd:1", "--parallel.dp=1", "--simulate=amd:2", "--x"]
    assert strip_simulate(argv) == ["--config", "c.toml", "--parallel.dp=1", "--x"]
    _parse.cache_clear()
    first = parse_simulate("nvidia:2,amd:1")
    first.append("amd")  # a caller's list is its own: the parsed spec is not changed by it
    assert parse_simulate("nvidia:2,amd:1") == ["nvidia", "nvidia", "amd"]
    assert _parse.cache_info().misses == 1 and _parse.cache_info().hits == 1
