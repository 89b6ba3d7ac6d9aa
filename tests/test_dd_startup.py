"""What a device-direct group checks before it carries a message: the engine wheel against torch, the RDMA devices
named, and a probe write between every pair with a deadline. Where RDMA hardware would be needed, the engine is
``RecordingEngine`` (a test double for Mooncake's RDMA transport) and the RDMA devices a fake sysfs tree."""

from __future__ import annotations

import logging
from pathlib import Path

import dd_doubles
import pytest
from dd_doubles import Fabric, RecordingEngine

from bimetal.comm.device_direct import EngineUnavailableError, builds, options_from
from bimetal.comm.device_direct import engine as engines
from bimetal.comm.device_direct.probe import ProbeFailedError, Side, describe, link_layers, local_fabric, probe_peers
from bimetal.errors import UserError

pytestmark = pytest.mark.timeout(60)
WHEELS = {"cuda12": ("mooncake-transfer-engine", "0.3.13.post1"), "cuda13": ("mooncake-transfer-engine-cuda13",
          "0.3.13.post1"), "rocm": ("mooncake-transfer-engine-rocm", "0.3.13.post1"),
          "cpu": ("mooncake-transfer-engine-non-cuda", "0.3.13.post1")}


# -- the engine build against torch's ----------------------------------------------------------------------------

@pytest.mark.parametrize(("engine", "torch_kind", "gpu", "says"), [
    ("cuda12", "cuda12", True, None),
    ("rocm", "rocm", True, None),
    ("cuda13", "cuda13", True, None),
    ("cpu", "cpu", False, None),
    ("cpu", "cuda12", False, None),  # no GPU visible: host memory only, any build serves it
    ("cuda12", "rocm", True, "is the CUDA 12 build (mooncake-transfer-engine 0.3.13.post1) but torch 2.9.0 is "
                             "a ROCm build, so the engine cannot address this GPU's memory; run `pip uninstall -y "
                             "mooncake-transfer-engine`, then `pip install "
                             "mooncake-transfer-engine-rocm==0.3.13.post1` (bimetal's [rocm] extra)"),
    ("cuda12", "cuda13", True, "torch 2.9.0 is a CUDA 13 build"),
    ("cpu", "cuda12", True, "is the CPU-only build (mooncake-transfer-engine-non-cuda 0.3.13.post1)"),
    ("rocm", "cuda12", True, "`pip install mooncake-transfer-engine==0.3.13.post1` (bimetal's [cuda] extra)"),
])
def test_the_engine_build_must_be_torchs(engine: str, torch_kind: str, gpu: bool, says: str | None) -> None:
    got = builds.build_problem([WHEELS[engine]], torch_kind, gpu, "2.9.0")
    assert got is None if says is None else (got is not None and says in got and "\n" not in got), got


def test_two_engine_wheels_installed_together_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the installed metadata for real: this environment's wheel, plus a second distribution that also
    provides ``mooncake/`` (written here as an installed one would be)."""
    installed = builds.installed_engines()
    if not installed:
        pytest.skip("no Mooncake wheel installed")
    assert builds.check_installed() is None  # this environment: one wheel, fit for its torch
    info = tmp_path / "mooncake_transfer_engine_rocm-0.3.13.post1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mooncake-transfer-engine-rocm\n"
                                   "Version: 0.3.13.post1\n")
    (info / "RECORD").write_text("mooncake/__init__.py,,\nmooncake/engine.so,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = builds.check_installed()
    assert got is not None and "mooncake-transfer-engine-rocm 0.3.13.post1" in got, got
    assert installed[0][0] in got and "overwrite each other's mooncake/ package" in got and "pip uninstall -y" in got
    # and the engine refuses to start on it, in that sentence (an engine that cannot start: the fallback policy)
    from bimetal.comm.device_direct.mooncake import open_engine
    with pytest.raises(EngineUnavailableError, match="overwrite each other's"):
        open_engine("127.0.0.1", "tcp")


# -- the RDMA devices ---------------------------------------------------------------------------------------------

def _sysfs(root: Path, devices: dict[str, str]) -> Path:
    for name, layer in devices.items():
        port = root / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "link_layer").write_text(layer + "\n")
    return root


def test_named_rdma_devices_must_exist_and_reach_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(engines, "VERBS_SYSFS", _sysfs(tmp_path, {"mlx5_0": "InfiniBand", "mlx5_1": "Ethernet"}))
    monkeypatch.delenv("BIMETAL_DD_PROTOCOL", raising=False)
    with pytest.raises(EngineUnavailableError) as caught:
        engines.choose_protocol(None, ("mlx5_1", "mlx5_9"))
    assert str(caught.value) == ("BIMETAL_DD_DEVICES (or the devices option) names mlx5_9, which is not an RDMA "
                                 f"device of this host (its devices under {tmp_path}: mlx5_0, mlx5_1)")
    assert engines.choose_protocol(None, ("mlx5_1",)) == "rdma"
    with caplog.at_level(logging.WARNING):
        assert engines.choose_protocol("tcp", ("mlx5_9",)) == "tcp"
    assert "BIMETAL_DD_DEVICES=mlx5_9 has no effect with the tcp protocol" in caplog.text
    monkeypatch.setenv("BIMETAL_DD_HOST", "127.0.0.1")
    monkeypatch.setenv("BIMETAL_DD_DEVICES", "mlx5_0, mlx5_1")
    assert options_from(None).devices == ("mlx5_0", "mlx5_1")
    assert options_from({"devices": ["mlx5_1"]}).devices == ("mlx5_1",)
    with pytest.raises(UserError, match="empty name"):
        options_from({"devices": "mlx5_0,,mlx5_1"})
    # the filter reaches the engine (over RDMA only)
    monkeypatch.setitem(engines.ENGINES, "recording", "dd_doubles")
    assert engines.open_engine("127.0.0.1", "rdma", "recording", ("mlx5_1",)).devices == ("mlx5_1",)  # type: ignore
    assert engines.open_engine("127.0.0.1", "tcp", "recording", ("mlx5_1",)).devices == ()  # type: ignore


def test_mooncake_is_started_on_the_named_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter hands the filter to Mooncake's ``initialize`` (its device-name argument) and names GPU memory
    the way its build does; ``BindingDouble`` stands in for the library (no RDMA device here to start it on)."""
    from bimetal.comm.device_direct import mooncake

    binding = dd_doubles.BindingDouble()
    binding.SUPPORT_HIP = True  # a ROCm build
    monkeypatch.setattr(mooncake, "_import_mooncake", lambda: binding)
    engine = mooncake.open_engine("10.0.0.1", "rdma", ("mlx5_0", "mlx5_3"))
    assert binding.initialized == [("10.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0,mlx5_3")]
    assert engine.gpu_prefix == "hip"


# -- the start-up probe -------------------------------------------------------------------------------------------

def _engines(fabric: Fabric) -> tuple[RecordingEngine, RecordingEngine, int, int]:
    a, b = RecordingEngine(fabric), RecordingEngine(fabric)
    a.connect(1, b.endpoint())
    b.connect(0, a.endpoint())
    import torch
    bufs = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    a.register(bufs[0].data_ptr(), 64, "cpu:0")
    b.register(bufs[1].data_ptr(), 64, "cpu:0")
    _engines.keep = bufs  # type: ignore[attr-defined]
    return a, b, bufs[0].data_ptr(), bufs[1].data_ptr()


def test_the_probe_names_both_sides_when_fabrics_do_not_meet(tmp_path: Path) -> None:
    ib = local_fabric("rdma", (), ["mlx5_0"], _sysfs(tmp_path / "a", {"mlx5_0": "InfiniBand"}))
    roce = local_fabric("rdma", ("mlx5_2",), ["mlx5_2", "mlx5_3"], _sysfs(tmp_path / "b", {"mlx5_2": "Ethernet"}))
    assert describe(ib) == "RDMA mlx5_0 (InfiniBand)" and describe(roce) == "RDMA mlx5_2 (RoCE)"
    down = _sysfs(tmp_path / "c", {"mlx5_4": "InfiniBand"}) / "mlx5_4" / "ports" / "1" / "state"
    down.write_text("1: DOWN\n")
    assert link_layers("mlx5_4", tmp_path / "c") == []  # a port the engine skips says nothing of the fabric
    a, _, src, dst = _engines(Fabric())
    got = probe_peers(a, Side(0, "nvidia-node", ib), {1: (Side(8, "amd-node", roce), dst)}, {1: src})
    assert got == ("the device-direct start-up probe found that rank 0 on nvidia-node (RDMA mlx5_0 (InfiniBand)) and "
                   "rank 8 on amd-node (RDMA mlx5_2 (RoCE)) share no fabric (InfiniBand and RoCE do not reach each "
                   "other); name RDMA devices on a fabric both hosts reach with BIMETAL_DD_DEVICES, or set "
                   "BIMETAL_DD_PROTOCOL=tcp")
    assert a.writes == 0  # told at once, no write waited for
    # one fabric: the write is made and lands
    assert probe_peers(a, Side(0, "n1", ib), {1: (Side(8, "n2", ib), dst)}, {1: src}) is None and a.writes == 1


def test_a_probe_write_that_never_completes_is_one_sentence_at_the_deadline() -> None:
    fabric = Fabric()
    a, _, src, dst = _engines(fabric)
    fabric.stall_all()
    tcp = {"protocol": "tcp", "devices": {}}
    got = probe_peers(a, Side(0, "n1", tcp), {1: (Side(1, "n2", tcp), dst)}, {1: src}, deadline_s=0.2)
    assert got is not None and got.startswith("the device-direct start-up probe: a write from rank 0 on n1 (TCP) to "
                                              "rank 1 on n2 (TCP) did not complete within 0.2 s;"), got


@pytest.mark.parametrize("fallback", ["error", "cpu-forward"])
def test_a_failed_probe_is_the_groups_fallback_decision_on_every_rank(fallback: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks (threads) build a group on RecordingEngines whose writes never complete: with ``error`` both
    raise the same sentence (a UserError: exit 2), with ``cpu-forward`` both get a cpu-forward group carrying it
    as its reason; neither hangs."""
    pytest.importorskip("bimetal.comm.cpu_forward")
    monkeypatch.setitem(engines.ENGINES, "recording", "dd_doubles")
    monkeypatch.setattr(engines, "VERBS_SYSFS", _sysfs(tmp_path, {"mlx5_0": "InfiniBand"}))
    monkeypatch.setattr("bimetal.comm.device_direct.pg.PROBE_S", 0.3)
    monkeypatch.setattr(dd_doubles, "FABRIC", Fabric())
    dd_doubles.FABRIC.stall_all()
    options = {"engine": "recording", "host": "127.0.0.1", "protocol": "rdma", "fallback": fallback}
    out, said = dd_doubles.start_group_pair(options, store_timeout_s=20, join_s=30)
    assert len(said) == (2 if fallback == "cpu-forward" else 0), said
    if fallback == "error":
        assert all(isinstance(out[r], ProbeFailedError) and isinstance(out[r], UserError) for r in (0, 1)), out
        text = str(out[0])
        assert text == str(out[1]) and "\n" not in text
        assert "a write from rank 4 on " in text and "(RDMA mlx5_0 (InfiniBand)) to rank 9 on " in text, text
        assert "did not complete within 0.3 s" in text and "BIMETAL_DD_FALLBACK=cpu-forward" in text, text
    else:
        assert all(type(out[r]).__name__ == "CpuForwardProcessGroup" for r in (0, 1)), out
        reasons = [out[r].fallback_reason for r in (0, 1)]
        assert reasons[0] == reasons[1] and "did not complete within 0.3 s" in reasons[0], reasons
        assert reasons[0].endswith("group falls back to cpu-forward as BIMETAL_DD_FALLBACK=cpu-forward asks")
        for r in (0, 1):
            out[r].shutdown()
    assert not dd_doubles.FABRIC.engines, "an engine was left open"
