"""Host-path terms of the cost model on hand-computed cases, and the spec fields that set them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bimetal.errors import UserError
from bimetal.plan import hostpath
from bimetal.plan.search import evaluate
from bimetal.plan.spec import load_spec, parse_spec


def _node(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"vendor": "nvidia", "gpu": "H100", "gpus_per_node": 8, "nics_per_node": 1,
                               "nic_gbps": 400, "h2d_gbps": 50, "intra_gbps": 400, "tcp_conn_gbps": 2.0,
                               "tcp_iface_gbps": 10.0, "host_copy_gbps": 100.0, "msg_latency_us": 0.001}
    return base | kw


def _groups(**kw: object):  # noqa: ANN202
    return parse_spec({"group": [_node(**kw), _node(vendor="amd", gpu="MI300X", **kw)]}, "x.toml").groups


def test_one_nic_with_eight_pairs_shares_the_interface_ceiling() -> None:
    a, _ = _groups()
    # 8 connections on one NIC: the TCP stack's 10 GB/s over 8 = 1.25 GB/s, under one connection's 2 GB/s.
    assert hostpath.wire_gbps(a, "gloo", "shared", 8) == pytest.approx(1.25)
    # one pair alone is held by its connection's ceiling, not the interface's
    assert hostpath.wire_gbps(a, "gloo", "shared", 1) == pytest.approx(2.0)
    # RDMA: the 50 GB/s line rate split 8 ways, no TCP ceilings
    assert hostpath.wire_gbps(a, "device-direct", "shared", 8) == pytest.approx(50 / 8)


def test_nic_per_gpu_and_striping() -> None:
    a, _ = _groups(nics_per_node=8)
    assert hostpath.wire_gbps(a, "cpu-forward", "per-gpu", 8) == pytest.approx(2.0)  # own NIC, one connection
    assert hostpath.wire_gbps(a, "cpu-forward", "striped", 8) == pytest.approx(8 * 1.25)  # 8 stripes, 8 on each NIC
    assert hostpath.wire_gbps(a, "cpu-forward", "striped", 1) == pytest.approx(8 * 2.0)
    a4, _ = _groups(nics_per_node=4)
    assert hostpath.nic_usage("per-gpu", 4, 8) == (1, 2)
    assert hostpath.wire_gbps(a4, "device-direct", "per-gpu", 8) == pytest.approx(25.0)


def test_concurrent_staging_copies_share_host_memory() -> None:
    a, _ = _groups()
    assert hostpath.copy_gbps(a, 1) == 50.0  # the PCIe rate binds
    assert hostpath.copy_gbps(a, 8) == pytest.approx(12.5)  # 100 GB/s of host memory over 8 copies


def test_synchronous_gloo_adds_copy_wire_copy_and_chunks_overlap() -> None:
    a, b = _groups(msg_latency_us=100.0)
    n = 64 * 2**20
    copy, wire, lat = n / 50e9, n / 2e9, 100e-6
    assert hostpath.pair_transfer_seconds(n, "gloo", a, b, "shared", 1) == pytest.approx(lat + copy + wire + copy)
    chunks = 16  # 64 MiB in 4 MiB chunks: the wire dominates, the copies add one chunk each
    cf = hostpath.pair_transfer_seconds(n, "cpu-forward", a, b, "shared", 1)
    assert cf == pytest.approx(lat + wire + 2 * copy / chunks)
    assert hostpath.pair_transfer_seconds(n, "device-direct", a, b, "shared", 1) == pytest.approx(lat + n / 50e9)
    # a message under one chunk cannot overlap: cpu-forward costs what gloo costs
    small = 2**20
    assert (hostpath.pair_transfer_seconds(small, "cpu-forward", a, b, "shared", 1)
            == pytest.approx(hostpath.pair_transfer_seconds(small, "gloo", a, b, "shared", 1)))


def test_gloo_allreduce_adds_host_copies_to_a_tcp_ring() -> None:
    a, _ = _groups()
    n = 1e9
    # 4 ranks inside one node: loopback ring at one connection's 2 GB/s; each of 8 copies at 100/8 GB/s
    expect = 2 * n / 12.5e9 + n * 2 * 3 / 4 / 2e9
    assert hostpath.gloo_allreduce_seconds(n, a, 4, 8, spans_nodes=False) == pytest.approx(expect)
    # leaving the node: 8 rings share one NIC's 10 GB/s TCP ceiling
    expect = 2 * n / 12.5e9 + n * 2 * 3 / 4 / 1.25e9
    assert hostpath.gloo_allreduce_seconds(n, a, 4, 8, spans_nodes=True) == pytest.approx(expect)


def test_spec_defaults_and_unknown_keys(tmp_path: Path) -> None:
    g = load_spec("configs/clusters/h200_mi325x.toml").groups[0]
    assert (g.tcp_conn_gbps, g.tcp_iface_gbps, g.host_copy_gbps, g.msg_latency_us) == (2.0, 50.0, 8 * 52.0, 30.0)
    bad = tmp_path / "c.toml"
    bad.write_text('[[group]]\nvendor = "nvidia"\ngpu = "H100"\ngpus_per_node = 8\nnics_per_node = 8\n'
                   'nic_gbps = 400\nintra_gbps = 400\ntcp_con_gbps = 2\n')
    with pytest.raises(UserError, match=r"c\.toml: group\[0\]: unknown key 'tcp_con_gbps'"):
        load_spec(bad)
    bad.write_text('nics = 2\n[[group]]\nvendor = "nvidia"\n')
    with pytest.raises(UserError, match=r"c\.toml: unknown key 'nics'"):
        load_spec(bad)


def test_every_group_on_gloo_is_priced_below_bimetal() -> None:
    spec = load_spec("configs/clusters/h200_mi325x.toml")
    args = ("llama3-8b", 8192, 256, 2, 8, 1, 1)
    gloo = evaluate(spec, *args, "gloo", dp_transport="gloo", homogeneous="gloo", nics="shared")
    cf = evaluate(spec, *args, "cpu-forward", dp_shard=8)
    dd = evaluate(spec, *args, "device-direct", dp_shard=8)
    assert gloo and cf and dd
    assert gloo.tflops_per_gpu < cf.tflops_per_gpu <= dd.tflops_per_gpu
    assert gloo.dp_allreduce > 10 * dd.dp_allreduce
