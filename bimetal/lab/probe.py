"""An iperf-like TCP probe between lab nodes: proves that a link's rate limit is physical.

The receiver runs in the destination namespace, bound to that node's NIC address; the sender runs in
the source namespace and connects to it, so the bytes cross the shaped veth pair. Several streams over
different NICs may run at once (the sum is what multi-NIC striping can at best reach).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bimetal.lab.cluster import LabCluster

_RECEIVER = r"""
import json, socket, sys, time
addr, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(1)
print("ready", flush=True)
s.settimeout(30); c, _ = s.accept(); c.settimeout(30)
n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
t1 = time.perf_counter()
print(json.dumps({"bytes": n, "t0": t0 or t1, "t1": t1}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
addr, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((addr, port), timeout=30)
buf = b"\0" * (1 << 20)
left = nbytes
while left > 0:
    c.sendall(buf[: min(left, len(buf))]); left -= min(left, len(buf))
c.close()
"""


def tcp_flows(lab: LabCluster, flows: list[tuple[str, str, int]], nbytes: int = 16 << 20,
              port: int = 5201, timeout: float = 60) -> list[dict[str, Any]]:
    """Run the flows ``(src_node, dst_node, nic)`` at once; per flow the bytes received and the monotonic
    times of the first and last byte (CLOCK_MONOTONIC is shared by all namespaces, so windows compare)."""
    receivers: list[subprocess.Popen[str]] = []
    senders: list[subprocess.Popen[str]] = []
    try:
        for i, (_, dst, nic) in enumerate(flows):
            addr = lab.address(dst, nic)
            p = lab.popen(dst, [sys.executable, "-c", _RECEIVER, addr, str(port + i)],
                          stdout=subprocess.PIPE, text=True)
            receivers.append(p)
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"probe receiver on {dst} {addr} did not start")
        for i, (src, dst, nic) in enumerate(flows):
            senders.append(lab.popen(src, [sys.executable, "-c", _SENDER, lab.address(dst, nic), str(port + i),
                                           str(nbytes)]))
        results: list[dict[str, Any]] = []
        for p in receivers:
            out, _ = p.communicate(timeout=timeout)
            results.append(json.loads(out.strip().splitlines()[-1]))
        for p in senders:
            p.wait(timeout=timeout)
        return results
    finally:
        for p in [*receivers, *senders]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)


def mbit(flow: dict[str, Any]) -> float:
    return float(flow["bytes"]) * 8 / max(flow["t1"] - flow["t0"], 1e-9) / 1e6


def tcp_throughput(lab: LabCluster, flows: list[tuple[str, str, int]], nbytes: int = 16 << 20,
                   port: int = 5201, timeout: float = 60) -> list[float]:
    """Run the flows at once; each flow's Mbit/s at the receiver."""
    return [mbit(f) for f in tcp_flows(lab, flows, nbytes, port, timeout)]


def aggregate_mbit(lab: LabCluster, flows: list[tuple[str, str, int]], nbytes: int = 16 << 20,
                   port: int = 5201, timeout: float = 60) -> float:
    """Run the flows at once; all bytes over the span from the first flow's first byte to the last one's end."""
    got = tcp_flows(lab, flows, nbytes, port, timeout)
    span = max(f["t1"] for f in got) - min(f["t0"] for f in got)
    return sum(float(f["bytes"]) for f in got) * 8 / max(span, 1e-9) / 1e6


_ECHO = r"""
import socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(1)
print("ready", flush=True)
s.settimeout(30); c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)):
    c.sendall(b)
"""

_PING = r"""
import socket, statistics, sys, time
addr, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((addr, port), timeout=30); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(count):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); times.append(time.perf_counter() - t)
print(statistics.median(times) * 1e3, flush=True)
"""


def tcp_rtt_ms(lab: LabCluster, src: str, dst: str, nic: int, count: int = 20, port: int = 5301) -> float:
    """Median round trip of a 1-byte TCP ping-pong from ``src`` to ``dst`` over NIC ``nic``, in ms."""
    echo = lab.popen(dst, [sys.executable, "-c", _ECHO, lab.address(dst, nic), str(port)], stdout=subprocess.PIPE,
                     text=True)
    try:
        assert echo.stdout is not None
        if echo.stdout.readline().strip() != "ready":
            raise RuntimeError(f"probe echo on {dst} did not start")
        ping = lab.popen(src, [sys.executable, "-c", _PING, lab.address(dst, nic), str(port), str(count)],
                         stdout=subprocess.PIPE, text=True)
        out, _ = ping.communicate(timeout=60)
        return float(out.strip())
    finally:
        if echo.poll() is None:
            echo.kill()
        echo.wait(timeout=5)
