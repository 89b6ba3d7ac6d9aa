"""The engine as published: the environment device-direct starts it in, the GID it will use, a registration it
refuses, its return codes, and the runtime its wheel needs.

No RDMA NIC, GPU or ROCm runtime is here, so the engine is ``RecordingEngine`` (a test double for Mooncake's RDMA
transport, which keeps the environment it started in), the Mooncake binding is ``BindingDouble`` (a test double
with the binding's return codes), the RDMA devices are fake ``/sys/class/infiniband`` trees, and the ROCm wheel's
facts are what its strings say (``dd_doubles.ROCM_0_3_13_POST1``). The installed CPU wheel's library is read for
real.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dd_doubles
import pytest
import torch
from dd_doubles import BindingDouble, Fabric, RecordingEngine

from bimetal.comm.device_direct import EngineUnavailableError, builds, engine_env, gids, options_from
from bimetal.comm.device_direct import engine as engines
from bimetal.comm.device_direct.engine import GroupStartError, RegistrationError, WriteStatus
from bimetal.comm.device_direct.probe import Side, local_fabric, probe_peers
from bimetal.errors import UserError

pytestmark = pytest.mark.timeout(60)
NO_HIP_VAR = engine_env.LibraryFacts(frozenset({"MC_FORCE_TCP", "MC_GID_INDEX"}), False, "engine.so")


@pytest.fixture(autouse=True)
def clean_engine_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every engine variable out of the environment before, and whatever the test left removed after."""
    for name in [*engine_env.engine_variables(), *engine_env.MANAGED]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engine_env, "_ours", {})
    monkeypatch.setitem(engines.ENGINES, "recording", "dd_doubles")
    monkeypatch.setattr(dd_doubles, "FACTS", None)
    yield
    for name in engine_env.engine_variables():
        os.environ.pop(name, None)


def _open(protocol: str, facts: engine_env.LibraryFacts | None = None, remote: bool = False,
          gid: int | None = None, host: str = "127.0.0.1") -> RecordingEngine:
    dd_doubles.FACTS = facts
    return engines.open_engine(host, protocol, "recording", (), gid, remote)  # type: ignore[return-value]


# -- the environment the engine starts in -------------------------------------------------------------------------

ROCM = dd_doubles.ROCM_0_3_13_POST1
ROCM_HIP = engine_env.LibraryFacts(ROCM.reads | {"MC_DISABLE_HIP"}, True, "engine.so")
ROCM_BOTH = engine_env.LibraryFacts(ROCM_HIP.reads | {"MC_DISABLE_HIP_TRANSPORT"}, True, "engine.so")


@pytest.mark.parametrize(("protocol", "facts", "remote", "gid", "sees"), [
    # tcp really is TCP: Mooncake installs RDMA wherever a verbs device exists unless MC_FORCE_TCP is set
    ("tcp", NO_HIP_VAR, True, 3, {"MC_FORCE_TCP": "1"}),
    ("tcp", ROCM, True, None, {"MC_FORCE_TCP": "1"}),  # (and MC_FORCE_TCP keeps the HIP transport out)
    ("rdma", NO_HIP_VAR, True, None, {}),
    ("rdma", NO_HIP_VAR, True, 3, {"MC_GID_INDEX": "3"}),
    ("rdma", ROCM, False, 3, {"MC_GID_INDEX": "3"}),  # peers on this node only: the HIP transport serves them
    ("rdma", ROCM_HIP, True, None, {"MC_DISABLE_HIP": "1"}),  # the variable the library reads
    ("rdma", ROCM_BOTH, True, None, {"MC_DISABLE_HIP_TRANSPORT": "1"}),
])
def test_the_environment_the_engine_starts_in(protocol: str, facts: engine_env.LibraryFacts, remote: bool,
                                              gid: int | None, sees: dict[str, str]) -> None:
    engine = _open(protocol, facts, remote, gid)
    assert engine.environment == sees and engine.protocol == protocol
    engine.close()


def test_the_published_rocm_wheel_cannot_serve_a_group_across_nodes_over_rdma(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """It reads neither variable that turns its HIP transport off: one sentence (an engine that cannot start),
    and a user's MC_DISABLE_HIP_TRANSPORT=1 is named as having no effect rather than trusted."""
    monkeypatch.setattr(dd_doubles, "WHEEL", "mooncake-transfer-engine-rocm 0.3.13.post1")
    started = len(dd_doubles.STARTED)
    with pytest.raises(EngineUnavailableError) as caught:
        _open("rdma", ROCM, remote=True)
    assert str(caught.value) == (
        "mooncake-transfer-engine-rocm 0.3.13.post1 installs its HIP transport beside RDMA, which labels this rank's "
        "memory 'hip' so that peers on other nodes cannot write to it, and it reads no variable that turns the HIP "
        "transport off (neither MC_DISABLE_HIP_TRANSPORT nor MC_DISABLE_HIP is in engine.so); set "
        "BIMETAL_DD_PROTOCOL=tcp for groups that cross nodes")
    monkeypatch.setenv("MC_DISABLE_HIP_TRANSPORT", "1")
    with pytest.raises(EngineUnavailableError, match=r"\(so MC_DISABLE_HIP_TRANSPORT=1 set here has no effect\); "):
        _open("rdma", ROCM, remote=True)
    assert len(dd_doubles.STARTED) == started  # refused before an engine started
    over_tcp = _open("tcp", ROCM, remote=True)  # what the sentence advises: starts (MC_FORCE_TCP keeps HIP out)
    assert over_tcp.environment == {"MC_FORCE_TCP": "1", "MC_DISABLE_HIP_TRANSPORT": "1"}
    over_tcp.close()


def test_the_users_engine_variables_win_and_are_logged(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MC_GID_INDEX", "1")
    with caplog.at_level(logging.WARNING):
        engine = _open("rdma", NO_HIP_VAR, True, gid=3)
    assert engine.environment == {"MC_GID_INDEX": "1"}
    assert "MC_GID_INDEX='1' set by the user is kept (device-direct would set '3')" in caplog.text
    engine.close()
    # Mooncake forces TCP whenever MC_FORCE_TCP is present, even "0": the engine is then TCP, and bimetal says so
    monkeypatch.setenv("MC_FORCE_TCP", "0")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        engine = _open("rdma", NO_HIP_VAR, True)
    assert engine.protocol == "tcp" and engine.environment["MC_FORCE_TCP"] == "0"
    assert "MC_FORCE_TCP='0' is set, and Mooncake uses TCP alone whenever it is set" in caplog.text
    engine.close()


def test_what_bimetal_set_for_one_engine_is_undone_for_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _open("tcp", NO_HIP_VAR, True)
    second = _open("rdma", NO_HIP_VAR, True, gid=3, host="fd00::1")
    assert first.environment == {"MC_FORCE_TCP": "1"}
    assert second.environment == {"MC_GID_INDEX": "3", "MC_USE_IPV6": "1"}  # not forced to TCP by the first
    for e in (first, second):
        e.close()


def test_the_gid_index_setting_is_checked_and_reaches_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIMETAL_DD_GID_INDEX", "3")
    assert options_from(None).gid_index == 3
    assert options_from({"gid_index": 1}).gid_index == 1
    monkeypatch.setenv("BIMETAL_DD_GID_INDEX", "three")
    with pytest.raises(UserError, match=r"^BIMETAL_DD_GID_INDEX='three' is not valid; set it to an integer from 0 "):
        options_from(None)
    monkeypatch.delenv("BIMETAL_DD_GID_INDEX")
    assert options_from(None).gid_index is None


def test_the_installed_wheels_library_is_read_for_the_variables_it_reads() -> None:
    facts = engine_env.library_facts()
    if facts is None:
        pytest.skip("no Mooncake wheel installed")
    # the CPU wheel (this environment's): reads MC_FORCE_TCP and the GID index, has no HIP transport, and reads
    # neither of the variables deployments use to turn one off
    assert {"MC_FORCE_TCP", "MC_GID_INDEX", "MC_USE_IPV6", "MC_TE_FILTERS"} <= facts.reads, sorted(facts.reads)
    assert not facts.hip_transport and not set(engine_env.HIP_OFF) & facts.reads


# -- the GID the engine will use ------------------------------------------------------------------------------------

def _roce(root: Path, device: str = "mlx5_2", table: dict[int, tuple[str, str]] | None = None,
          layer: str = "Ethernet") -> Path:
    port = root / device / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "link_layer").write_text(layer + "\n")
    (port / "state").write_text("4: ACTIVE\n")
    table = table if table is not None else {
        0: ("fe80:0000:0000:0000:0202:c9ff:fe00:0001", "IB/RoCE v1"),
        1: ("fe80:0000:0000:0000:0202:c9ff:fe00:0001", "RoCE v2"),
        2: ("0000:0000:0000:0000:0000:ffff:0a00:0104", "IB/RoCE v1"),
        3: ("0000:0000:0000:0000:0000:ffff:0a00:0104", "RoCE v2")}
    for i in range(8):
        gid, kind = table.get(i, ("0000:0000:0000:0000:0000:0000:0000:0000", ""))
        (port / "gids" / str(i)).write_text(gid + "\n")
        if kind:
            (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
    return root


def test_a_gid_that_does_not_route_is_one_clause_naming_the_variable(tmp_path: Path) -> None:
    root = _roce(tmp_path)
    fix = "BIMETAL_DD_GID_INDEX"
    assert gids.problem(root, ["mlx5_2"], 0, "from BIMETAL_DD_GID_INDEX", fix) == (
        "RDMA device mlx5_2 port 1 uses GID index 0 (from BIMETAL_DD_GID_INDEX): fe80::202:c9ff:fe00:1, IB/RoCE v1, "
        "which is link-local and does not route between nodes; set BIMETAL_DD_GID_INDEX=3 (RoCE v2 ::ffff:10.0.1.4)")
    assert "which is RoCE v1 (an Ethernet frame, not IP) and does not route" in str(gids.problem(root, ["mlx5_2"], 2,
                                                                                                  "x", fix))
    assert gids.problem(root, ["mlx5_2"], 3, "x", fix) is None
    assert gids.problem(root, ["mlx5_2"], None, "chosen by the engine", fix) is None  # a routable one exists
    assert "uses GID index 6 (x), which is no such entry" in str(gids.problem(root, ["mlx5_2"], 6, "x", fix))
    bare = _roce(tmp_path / "bare", table={0: ("fe80:0000:0000:0000:0202:c9ff:fe00:0001", "RoCE v2")})
    assert str(gids.problem(bare, ["mlx5_2"], None, "chosen by the engine", fix)).startswith(
        "RDMA device mlx5_2 port 1 has no RoCE v2 GID with an IP address (its GIDs: 0: fe80::202:c9ff:fe00:1, "
        "RoCE v2), so RDMA cannot cross nodes; ")
    ib = _roce(tmp_path / "ib", "mlx5_0", layer="InfiniBand")
    assert gids.problem(ib, ["mlx5_0"], 0, "x", fix) is None  # InfiniBand routes by LID: not judged


def test_the_probe_gives_the_gid_as_the_reason_a_write_across_nodes_failed(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    root = _roce(tmp_path)
    monkeypatch.setenv("MC_GID_INDEX", "0")  # the user's: it is the variable to change
    mine = local_fabric("rdma", ("mlx5_2",), ["mlx5_2"], root)
    assert mine["gid"].startswith("RDMA device mlx5_2 port 1 uses GID index 0 (from MC_GID_INDEX, set by the user)")
    assert mine["gid"].endswith("set MC_GID_INDEX=3 (RoCE v2 ::ffff:10.0.1.4)")
    fabric = Fabric()
    a, b = RecordingEngine(fabric), RecordingEngine(fabric)
    a.connect(1, b.endpoint())
    bufs = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    a.register(bufs[0].data_ptr(), 64, "cpu:0")
    b.register(bufs[1].data_ptr(), 64, "cpu:0")
    fabric.stall_all()
    theirs = {"protocol": "rdma", "devices": {"mlx5_9": ["Ethernet"]}, "gid": ""}
    got = probe_peers(a, Side(0, "amd-node", mine), {1: (Side(8, "nvidia-node", theirs), bufs[1].data_ptr())},
                      {1: bufs[0].data_ptr()}, deadline_s=0.2)
    assert got is not None and got.startswith(
        "the device-direct start-up probe: a write from rank 0 on amd-node (RDMA mlx5_2 (RoCE)) to rank 8 on "
        "nvidia-node (RDMA mlx5_9 (RoCE)) did not complete within 0.2 s; on rank 0 (amd-node) RDMA device mlx5_2 "
        "port 1 uses GID index 0"), got
    assert "\n" not in got and got.endswith("set MC_GID_INDEX=3 (RoCE v2 ::ffff:10.0.1.4)")
    # on one node the general advice stays (a link-local GID reaches a peer there), and it is right: tcp forces TCP
    same = probe_peers(a, Side(0, "n1", mine), {1: (Side(8, "n1", theirs), bufs[1].data_ptr())},
                       {1: bufs[0].data_ptr()}, deadline_s=0.1)
    assert same is not None and same.endswith("or set BIMETAL_DD_PROTOCOL=tcp"), same


# -- a registration the engine refuses, inside the group's constructor ------------------------------------------------

def _exchange(pgs: dict[int, Any]) -> torch.Tensor:
    """One message from rank 0 to rank 1 over the groups made (threads); what rank 1 received."""
    got = torch.zeros(4)

    def send() -> None:
        pgs[0].send([torch.arange(4.0)], 1, 0).wait()

    t = threading.Thread(target=send)
    t.start()
    pgs[1].recv([got], 0, 0).wait()
    t.join(10)
    return got


@pytest.mark.parametrize("fallback", ["error", "cpu-forward"])
def test_a_refused_registration_is_every_ranks_fallback_decision(fallback: str, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Group rank 1's engine refuses to register its receive slots (as Mooncake does for GPU memory without the
    peer-memory driver): both ranks learn it from its record, with one sentence; ``error`` stops both with it,
    ``cpu-forward`` gives both a cpu-forward group that carries a message."""
    pytest.importorskip("bimetal.comm.cpu_forward")
    monkeypatch.setattr(engines, "VERBS_SYSFS", tmp_path / "none")
    monkeypatch.setattr(dd_doubles, "FABRIC", Fabric(refusing_threads={"rank-1"}))
    options = {"engine": "recording", "host": "127.0.0.1", "protocol": "tcp", "fallback": fallback}
    # the store's timeout is the group's (300 s): a rank waiting it out would trip the join's 50 s
    out, said = dd_doubles.start_group_pair(options, store_timeout_s=300, join_s=50)
    if fallback == "error":
        assert all(isinstance(out[r], GroupStartError) and isinstance(out[r], UserError) for r in (0, 1)), out
        text = str(out[0])
        assert text == str(out[1]) and "\n" not in text, out
        assert text.startswith("the device-direct group could not start on global rank 9 on "), text
        assert ": Mooncake could not register " in text and " of cpu:0 memory for tcp (rc=-1)" in text, text
        assert text.endswith("(or set BIMETAL_DD_FALLBACK=cpu-forward to use cpu-forward instead)"), text
        assert not said
    else:
        assert all(type(out[r]).__name__ == "CpuForwardProcessGroup" for r in (0, 1)), out
        reasons = {out[r].fallback_reason for r in (0, 1)}
        assert len(reasons) == 1 and len(said) == 2, (reasons, said)
        assert "could not start on global rank 9 on " in reasons.pop()
        assert torch.equal(_exchange(out), torch.arange(4.0))  # the job goes on, over cpu-forward
        for r in (0, 1):
            out[r].shutdown()
    assert not dd_doubles.FABRIC.engines, "an engine was left open"


# -- the Mooncake adapter against the binding's return codes ---------------------------------------------------------

def _adapter(monkeypatch: pytest.MonkeyPatch, binding: BindingDouble, host: str = "10.0.0.1",
             protocol: str = "rdma") -> Any:
    from bimetal.comm.device_direct import mooncake

    monkeypatch.setattr(mooncake, "_import_mooncake", lambda: binding)
    return mooncake.open_engine(host, protocol)


def test_a_timed_out_write_frees_its_batch_and_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = BindingDouble(check_codes=[0, -2, -1])
    engine = _adapter(monkeypatch, binding)
    engine.connect(1, {"engine": "mooncake", "protocol": "rdma", "session": "10.0.0.2:15001"})
    first = engine.post_write(1, 1, 2, 64)
    assert engine.poll(first) is WriteStatus.PENDING
    assert engine.poll(first) is WriteStatus.FAILED and binding.batches == set()  # timed out: freed, not leaked
    second = engine.post_write(1, 1, 2, 64)
    assert engine.poll(second) is WriteStatus.FAILED and binding.batches == set()


def test_unregister_results_are_checked(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    binding = BindingDouble(unregister_rc=-1)
    engine = _adapter(monkeypatch, binding)
    engine.register(0x1000, 64, "cpu:0")
    with pytest.raises(RuntimeError, match=r"^Mooncake could not unregister the memory at 0x1000 \(rc=-1\)$"):
        engine.unregister(0x1000)
    engine.register(0x2000, 64, "cpu:0")
    with caplog.at_level(logging.WARNING):
        engine.close()
    assert "could not unregister the memory at 0x2000 at close (rc=-1)" in caplog.text


def test_a_refused_gpu_registration_says_what_rdma_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _adapter(monkeypatch, BindingDouble(register_rc=-1))
    with pytest.raises(RegistrationError) as caught:
        engine.register(0x1000, 4096, "cuda:0")
    assert str(caught.value) == (
        "Mooncake could not register 4096 bytes of cuda:0 memory for rdma (rc=-1): RDMA to GPU memory needs the "
        "peer-memory kernel module (nvidia-peermem on NVIDIA, amdgpu's peer-memory support on AMD) or dma-buf "
        "support in the driver and NIC; load that support, or set BIMETAL_DD_PROTOCOL=tcp")


def test_an_ipv6_host_is_a_bracketed_session(monkeypatch: pytest.MonkeyPatch) -> None:
    binding = BindingDouble()
    engine = _adapter(monkeypatch, binding, host="fd00::7")
    assert engine.endpoint()["session"] == "[fd00::7]:15001"
    peer = {"engine": "mooncake", "protocol": "rdma", "session": "[fd00::8]:15001"}
    engine.connect(1, peer)
    engine.post_write(1, 1, 2, 8)
    assert binding.submitted == ["[fd00::8]:15001"] and binding.initialized[0][0] == "fd00::7"


# -- the runtime each wheel needs ----------------------------------------------------------------------------------

ROCM_WHEEL = [("mooncake-transfer-engine-rocm", "0.3.13.post1")]


def test_the_rocm_wheel_needs_a_rocm_7_torch() -> None:
    got = builds.runtime_problem(ROCM_WHEEL, "6.4.43482-0f2d60242", "2.9.0+rocm6.4")
    assert got == ("the Mooncake ROCm build (mooncake-transfer-engine-rocm 0.3.13.post1) links the ROCm 7 runtime "
                   "(libamdhip64.so.7) but torch 2.9.0+rocm6.4 is built for ROCm 6.4, and one process cannot load "
                   "both; install a torch built for ROCm 7 (`pip install torch --index-url "
                   "https://download.pytorch.org/whl/rocm7.X`, see pytorch.org)")
    assert builds.runtime_problem(ROCM_WHEEL, "7.0.51831-a3e329ad8", "2.9.0+rocm7.0") is None
    assert builds.runtime_problem([("mooncake-transfer-engine", "0.3.13.post1")], None) is None


def test_a_wheel_that_cannot_load_names_the_missing_library_not_itself() -> None:
    got = builds.load_problem("libamdhip64.so.7: cannot open shared object file: No such file or directory",
                              ROCM_WHEEL)
    assert got == ("Mooncake Transfer Engine (mooncake-transfer-engine-rocm 0.3.13.post1) is installed but could not "
                   "load because libamdhip64.so.7 is not on this node's library path; install the ROCm 7 runtime (a "
                   "torch built for ROCm 7 carries it)")
    assert "pip install" not in got
    old_glibc = builds.load_problem("/lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.35' not found (required by "
                                    "/x/mooncake/engine.so)", ROCM_WHEEL)
    assert "could not load because it needs glibc 2.35 and this node has glibc " in old_glibc, old_glibc
    # and for real, where this machine lacks libibverbs (the CPU wheel is installed but cannot load)
    from bimetal.comm.device_direct import mooncake

    if not builds.installed_engines():
        pytest.skip("no Mooncake wheel installed")
    try:
        mooncake._import_mooncake()
    except EngineUnavailableError as exc:
        assert "is installed but could not load because libibverbs.so.1" in str(exc), exc
        assert "; run `apt-get install libibverbs1`" in str(exc) and "pip install" not in str(exc), exc
    else:
        pytest.skip("the engine loads here")
