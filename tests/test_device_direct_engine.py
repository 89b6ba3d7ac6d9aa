"""Tests for the device-direct engine interface and its Mooncake adapter (real engine, TCP loopback, one process)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import engine_unavailable

from bimetal.comm.device_direct.engine import EngineUnavailableError, WriteStatus, choose_protocol, open_engine

pytestmark = pytest.mark.timeout(60)


def _wait(engine, handle, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (status := engine.poll(handle)) is WriteStatus.PENDING:
        assert time.monotonic() < deadline, "write did not complete in time"
        time.sleep(0.001)
    return status


@pytest.fixture()
def pair():
    if (why := engine_unavailable()) is not None:
        pytest.skip(why)
    a = open_engine("127.0.0.1", "tcp")
    b = open_engine("127.0.0.1", "tcp")
    a.connect(1, b.endpoint())
    b.connect(0, a.endpoint())
    yield a, b
    a.close()
    b.close()


def test_write_is_bit_identical_and_notifies(pair):
    a, b = pair
    src = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32)
    dst = torch.zeros_like(src)
    nbytes = src.numel() * src.element_size()
    a.register(src.data_ptr(), nbytes, "cpu")
    b.register(dst.data_ptr(), nbytes, "cpu")
    assert _wait(a, a.post_write(1, src.data_ptr(), dst.data_ptr(), nbytes)) is WriteStatus.DONE
    assert torch.equal(src, dst)
    a.notify(1, '{"seq": 1}')
    deadline = time.monotonic() + 5
    notes: list[str] = []
    while not notes and time.monotonic() < deadline:
        notes = b.notifications()
        time.sleep(0.01)
    assert notes == ['{"seq": 1}']
    assert a.probe(1)


def test_endpoint_mismatch_is_rejected(pair):
    a, b = pair
    with pytest.raises(ValueError, match="malformed"):
        a.connect(2, {"engine": "nixl", "session": "x:1"})
    with pytest.raises(EngineUnavailableError, match="BIMETAL_DD_PROTOCOL"):
        a.connect(2, {**b.endpoint(), "protocol": "rdma"})


def test_protocol_choice(monkeypatch, tmp_path):
    monkeypatch.setattr("bimetal.comm.device_direct.engine.VERBS_SYSFS", tmp_path / "none")
    assert choose_protocol() == "tcp"
    with pytest.raises(EngineUnavailableError, match="no verbs device"):
        choose_protocol("rdma")
    with pytest.raises(EngineUnavailableError, match="unknown device-direct protocol"):
        choose_protocol("carrier-pigeon")
    monkeypatch.setenv("BIMETAL_DD_PROTOCOL", "tcp")
    assert choose_protocol() == "tcp"
    with pytest.raises(EngineUnavailableError, match="unknown device-direct engine"):
        open_engine("127.0.0.1", "tcp", name="nope")


def test_default_host_is_the_nic_paired_with_this_ranks_gpu(monkeypatch, tmp_path):
    """Without a PCI topology (this machine): by position from the local rank, wrapping. On a fake MI300X node
    whose NIC names sort against their PCI order, simulated local rank i (the node's GPU i) takes the NIC behind
    GPU i's switch, as cpu-forward's choice does (``tests/test_pci_pairing.py``), not the i-th name."""
    from fake_sysfs import mi300x_node

    from bimetal.comm.device_direct import default_host
    from bimetal.topology.records import NicInfo

    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("BIMETAL_SYSFS", str(tmp_path / "empty"))  # no PCI devices, no GPUs: nothing to pair by
    monkeypatch.setenv("BIMETAL_SIMULATE", "amd:8")
    nics = [NicInfo("eth0", "10.0.0.1"), NicInfo("eth1", "10.0.1.1")]
    assert default_host(0, nics) == "10.0.0.1"
    assert default_host(1, nics) == "10.0.1.1"
    assert default_host(5, nics) == "10.0.1.1"  # fewer NICs than local ranks: wrapping, as cpu-forward's pick
    assert default_host(1, []) == "127.0.0.1"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_host(None, nics) == "10.0.1.1"
    shuffled = ["ens7np0", "ens3np0", "ens5np0", "ens0np0", "ens6np0", "ens1np0", "ens4np0", "ens2np0"]
    _, in_pci_order = mi300x_node(tmp_path / "sys", names=shuffled)
    monkeypatch.setenv("BIMETAL_SYSFS", str(tmp_path / "sys"))
    named = [NicInfo(n, f"10.0.{i}.1", 24) for i, n in enumerate(sorted(in_pci_order))]
    address = {n.name: n.address for n in named}
    got = []
    for i in range(8):  # the rank's GPU is its own (LOCAL_RANK's), as on a real node
        monkeypatch.setenv("LOCAL_RANK", str(i))
        got.append(default_host(None, named))
    assert got == [address[n] for n in in_pci_order], got
    assert got != [n.address for n in named]  # by position it would have been the name-sorted list


def test_options_are_checked(monkeypatch):
    from bimetal.comm.device_direct import options_from

    monkeypatch.setenv("BIMETAL_DD_HOST", "127.0.0.1")
    assert options_from({"inline_bytes": 0}).inline_bytes == 0
    with pytest.raises(EngineUnavailableError, match="BIMETAL_DD_INLINE_BYTES"):
        options_from({"inline_bytes": 1 << 30})
    with pytest.raises(EngineUnavailableError, match="BIMETAL_DD_WINDOW"):
        options_from({"window": 0})
