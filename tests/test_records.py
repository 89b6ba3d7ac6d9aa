"""Topology records: JSON round trip, field-by-field validation, and the exchange over a real store."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from bimetal.topology.exchange import exchange_topology
from bimetal.topology.records import ClusterView, NicInfo, RankRecord, TopologyError, local_nics


def _record(rank: int = 0, **changes) -> RankRecord:
    base = dict(rank=rank, local_rank=rank % 2, host=f"node{rank // 2}", vendor="nvidia" if rank < 2 else "amd",
                device="NVIDIA H200", memory_bytes=141 * 2**30,
                nics=(NicInfo("eth0", "10.0.0.1", 24), NicInfo("eth1", "10.0.1.1", 24)))
    base.update(changes)
    return RankRecord(**base)


def test_round_trip_is_plain_json() -> None:
    rec = _record(3, gpu_pci="0000:18:00.0", nic_order=(("eth1", "same PCIe switch"), ("eth0", "same NUMA node")),
                  rdma=("mlx5_3", "same PCIe switch"))
    text = rec.to_json()
    payload = json.loads(text)
    assert payload["version"] == 3 and payload["nics"][1] == {"name": "eth1", "address": "10.0.1.1", "prefix": 24}
    assert payload["bimetal"] and payload["torch"] and payload["wire"]["cpu-forward"] >= 1
    assert RankRecord.from_json(text, expected_rank=3) == rec


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p.pop("host"), "'host' is missing"),
        (lambda p: p.update(vendor="intel"), "'vendor'"),
        (lambda p: p.update(memory_bytes=-1), "'memory_bytes'"),
        (lambda p: p.update(memory_bytes=True), "'memory_bytes'"),
        (lambda p: p.update(rank=5), "'rank' says 5"),
        (lambda p: p.update(rdma=["mlx5_0"]), "'rdma' must be empty or [device, reason]"),
        (lambda p: p.update(nic_order=[["eth0"]]), "'nic_order"),
        (lambda p: p.update(extra="x"), "'extra' is not a known field"),
        (lambda p: p.update(nics=[{"name": "eth0", "address": "10.0.0.1", "prefix": 33}]), "'nics[0].prefix'"),
        (lambda p: p.update(torch=""), "'torch'"),
        (lambda p: p.update(device_index=-2), "'device_index'"),
        (lambda p: p.update(nics=[{"name": "eth0", "address": "not-an-ip", "prefix": 24}]), "'nics[0].address'"),
        (lambda p: p.update(nics=[{"name": "a/b", "address": "10.0.0.1", "prefix": 24}]), "'nics[0].name'"),
        (lambda p: p.update(nics=[{"name": "eth0", "address": "10.0.0.1"}]), "'nics[0].prefix' is missing"),
        (lambda p: p.update(nics="eth0"), "'nics'"),
        (lambda p: p.update(device=""), "'device'"),
    ],
)
def test_bad_fields_are_named_with_the_rank(mutate, field: str) -> None:
    payload = json.loads(_record(1).to_json())
    mutate(payload)
    with pytest.raises(TopologyError) as info:
        RankRecord.from_json(json.dumps(payload), expected_rank=1)
    assert "rank 1" in str(info.value) and field in str(info.value)


def test_not_json_and_not_an_object() -> None:
    with pytest.raises(TopologyError, match="rank 2 is not valid JSON"):
        RankRecord.from_json(b"\x80\x03pickle", expected_rank=2)
    with pytest.raises(TopologyError, match="is a list"):
        RankRecord.from_json("[1, 2]", expected_rank=2)


def test_cluster_view_checks_consistency() -> None:
    view = ClusterView([_record(r) for r in (2, 0, 3, 1)])
    assert view.world_size == 4 and view.hosts == ["node0", "node1"] and view.vendors == ["nvidia", "amd"]
    assert view.ranks_on("node1") == [2, 3] and view.vendor_of(2) == "amd" and view.is_mixed()
    assert "eth1=10.0.1.1/24" in view.format_table()
    with pytest.raises(TopologyError, match="ranks 0..2 once each"):
        ClusterView([_record(0), _record(1), _record(3)])
    with pytest.raises(TopologyError, match="both claim local rank 0"):
        ClusterView([_record(0), _record(1, local_rank=0)])


def test_local_nics_lists_up_ipv4_interfaces() -> None:
    nics = local_nics()
    assert nics, "every host has at least loopback"
    assert all(n.name and n.address.count(".") == 3 for n in nics)
    assert any(n.address.startswith("127.") for n in local_nics(include_loopback=True))


def _exchange_all(records_json: list[str], world: int) -> list[object]:
    """Run exchange_topology on ``world`` threads sharing one TCPStore; each gets a view or an error."""
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    results: list[object] = [None] * world

    def rank_main(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, world, False, timeout=timedelta(seconds=20))
        store.set(f"bimetal/topo/v1/{rank}", records_json[rank])
        try:
            # Publish our own raw JSON (possibly malformed) and read everyone's through the real path.
            results[rank] = exchange_topology(store, rank, world, timedelta(seconds=10),
                                              record=_RawRecord(records_json[rank]))  # type: ignore[arg-type]
        except TopologyError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


class _RawRecord:
    """Stands in for a RankRecord whose JSON was tampered with on the way (a malformed record)."""

    def __init__(self, text: str):
        self.text = text

    def to_json(self) -> str:
        return self.text


def test_exchange_builds_the_same_view_everywhere() -> None:
    results = _exchange_all([_record(r).to_json() for r in range(4)], 4)
    assert all(isinstance(v, ClusterView) for v in results)
    assert len({v.to_json() for v in results}) == 1  # type: ignore[union-attr]


def test_malformed_record_stops_every_rank_with_the_same_sentence() -> None:
    payloads = [_record(r).to_json() for r in range(3)]
    bad = json.loads(payloads[1])
    bad["memory_bytes"] = "lots"
    payloads[1] = json.dumps(bad)
    results = _exchange_all(payloads, 3)
    messages = {str(e) for e in results}
    assert all(isinstance(e, TopologyError) for e in results)
    assert len(messages) == 1 and "rank 1" in messages.pop()


# -- versions: what the ranks' software must agree on ---------------------------------------------------------
def test_an_older_bimetals_record_is_refused_in_one_sentence() -> None:
    """Rank 1 publishes what bimetal 0.1.0's first record version looked like (no device index, prefixes or
    versions): every rank stops saying that rank 1 runs an older bimetal, not that a field is unknown."""
    old = {"version": 1, "rank": 1, "local_rank": 1, "host": "node0", "vendor": "amd", "device": "MI300X",
           "memory_bytes": 0, "nics": [{"name": "eth0", "address": "10.0.0.1"}]}
    results = _exchange_all([_record(0).to_json(), json.dumps(old)], 2)
    assert all(isinstance(e, TopologyError) for e in results)
    assert {str(e) for e in results} == {"rank 1 published a version-1 topology record but this bimetal (0.1.0) reads "
                                         "version 3: rank 1 runs an older bimetal; install one bimetal release on "
                                         "every node."}


def test_version_skew_names_two_ranks_and_their_versions() -> None:
    results = _exchange_all([_record(0).to_json(), _record(1, bimetal="0.0.9").to_json(), _record(2).to_json()], 3)
    assert {str(e) for e in results} == {"ranks 0 and 1 run different bimetal versions (rank 0: 0.1.0, rank 1: "
                                         "0.0.9); install one bimetal release on every node."}


def test_vendor_builds_of_one_torch_release_agree_and_other_releases_do_not() -> None:
    agree = [_record(0, torch="2.6.0+cu124"), _record(1, torch="2.6.0+rocm6.2"), _record(2, torch="2.6.1"),
             _record(3, torch="2.6.0a0+git1234")]
    assert ClusterView(agree).world_size == 4
    with pytest.raises(TopologyError) as caught:
        ClusterView([_record(0, torch="2.6.0+cu124"), _record(1, torch="2.7.0+rocm6.3")])
    assert str(caught.value).startswith("ranks 0 and 1 run different torch releases (rank 0: 2.6.0+cu124, rank 1: "
                                        "2.7.0+rocm6.3)")
    with pytest.raises(TopologyError, match=r"^ranks 0 and 1 speak different transport protocol versions"):
        ClusterView([_record(0), _record(1, wire={"cpu-forward": 99, "device-direct": 1})])


def test_device_direct_refuses_two_engine_releases() -> None:
    from bimetal.topology.versions import engine_mismatch

    assert engine_mismatch([0, 4], ["0.3.13", "0.3.13.post1"]) is None  # a post-release repackages the same code
    assert engine_mismatch([0, 4], ["0.3.13", ""]) is None  # no engine on rank 4: its start fails, policy speaks
    assert engine_mismatch([0, 4, 5], ["0.3.13", "0.3.13", "0.3.12"]) == (
        "ranks 0 and 5 run different Mooncake transfer engine releases (rank 0: 0.3.13, rank 5: 0.3.12); "
        "device-direct needs one engine release on both ends: install the same version of the engine wheel for "
        "each node's torch build.")
