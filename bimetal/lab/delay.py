"""Link latency for kernels without netem: packets held in user space through the kernel's NFQUEUE.

Where ``sch_netem`` exists the lab uses it. Where it does not (this machine's kernel has tbf and htb, no
netem), a NIC's latency is made this way instead: iptables sends every packet the node receives on that NIC
(INPUT ``-i``) to NFQUEUE queue number ``nic``; one small daemon per NIC, running inside the node's
namespace, reads the queue and gives each packet its ACCEPT verdict the node's ``latency_ms`` later. So a
packet from A to B waits B's latency, B to A waits A's: the round trip is ``latency_A + latency_B``, as with
netem (which puts half of each node's latency on each end); with equal latencies the one-way times match too.

Only arriving packets are held, never departing ones: a packet held on its way out still counts against its
socket's TCP Small Queues budget, which throttled a 200 Mbit/s link with 10 ms to 9 Mbit/s when tried;
one that crossed the veth no longer does.

The delay is one constant per queue, so packets leave in the order they came and one batch verdict
("accept every packet up to id N") releases all that are due; a packet costs one message in, and the
daemon is idle between packets. The kernel holds the packets, not the daemon: the daemon only ever keeps
(due time, id) pairs. The rules use ``--queue-bypass``, so a NIC whose daemon is gone passes traffic
undelayed instead of dropping it; the daemon lives in the node's namespace, so the lab's teardown (and
the clean-up of a stale lab) kills it with everything else there.

The netlink messages are built by hand (nfnetlink_queue's config, packet and batch-verdict messages, see
``linux/netfilter/nfnetlink_queue.h``); the packet payload is never copied to user space.

``python -m bimetal.lab.delay --queue N --delay-ms D`` is the daemon; ``bimetal.lab.net.start_delay`` and
``stop_delay`` manage one per NIC. ``start_delay`` runs this file by its path (``python .../bimetal/lab/delay.py
--queue N --delay-ms D``), which reads those two options without importing the ``bimetal`` package: that import
imports torch (about 2.3 s of CPU) to register bimetal's back-ends, and a daemon that only holds packets needs none
of it. So this module imports nothing of bimetal at the top; any other command line goes to ``main``'s parser.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path

NETLINK_NETFILTER = 12
_SUBSYS_QUEUE = 3 << 8
_MSG_PACKET, _MSG_VERDICT_BATCH, _MSG_CONFIG = _SUBSYS_QUEUE | 0, _SUBSYS_QUEUE | 3, _SUBSYS_QUEUE | 2
_CFG_CMD, _CFG_PARAMS, _CFG_QUEUE_MAXLEN = 1, 2, 3
_CMD_BIND = 1
_COPY_META = 1
_PACKET_HDR, _VERDICT_HDR = 1, 2
_NF_ACCEPT = 1
_NLMSG_ERROR = 2
_F_REQUEST, _F_ACK = 1, 4
_NLMSG = struct.Struct("=IHHII")
_QUEUE_MAXLEN = 1 << 16


def _attr(kind: int, data: bytes) -> bytes:
    size = 4 + len(data)
    return struct.pack("=HH", size, kind) + data + b"\0" * (-size % 4)


def _message(kind: int, queue: int, payload: bytes, seq: int, ack: bool) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + payload
    return _NLMSG.pack(_NLMSG.size + len(body), kind, _F_REQUEST | (_F_ACK if ack else 0), seq, 0) + body


def _configure(sock: socket.socket, queue: int) -> None:
    """Bind ``queue`` for IPv4, metadata only (no payload copy), room for many held packets."""
    steps = [_attr(_CFG_CMD, struct.pack("=BBH", _CMD_BIND, 0, socket.htons(socket.AF_INET))),
             _attr(_CFG_PARAMS, struct.pack("!IB", 0, _COPY_META)),
             _attr(_CFG_QUEUE_MAXLEN, struct.pack("!I", _QUEUE_MAXLEN))]
    for seq, payload in enumerate(steps, 1):
        sock.send(_message(_MSG_CONFIG, queue, payload, seq, ack=True))
        reply = sock.recv(4096)
        _, kind, _, _, _ = _NLMSG.unpack_from(reply)
        if kind == _NLMSG_ERROR and struct.unpack_from("=i", reply, _NLMSG.size)[0] != 0:
            err = -struct.unpack_from("=i", reply, _NLMSG.size)[0]
            raise OSError(err, f"nfnetlink_queue refused config step {seq} for queue {queue}: {os.strerror(err)}")


def _packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets in one ``recv`` (several netlink messages may come at once)."""
    ids, off = [], 0
    while off + _NLMSG.size <= len(data):
        size, kind, _, _, _ = _NLMSG.unpack_from(data, off)
        if size < _NLMSG.size:
            break
        if kind == _MSG_PACKET:
            at, end = off + _NLMSG.size + 4, off + size  # past nlmsghdr and nfgenmsg: the attributes
            while at + 4 <= end:
                alen, akind = struct.unpack_from("=HH", data, at)
                if alen < 4:
                    break
                if akind & 0x7FFF == _PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, at + 4)[0])
                at += alen + (-alen % 4)
        off += size + (-size % 4)
    return ids


def serve(queue: int, delay_s: float) -> None:
    """Hold every packet of ``queue`` for ``delay_s``, then accept it (runs until SIGTERM)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    with contextlib.suppress(OSError):  # as root the buffer may exceed rmem_max: a burst never overflows it
        sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
    _configure(sock, queue)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    sock.setblocking(False)
    seq = 100
    while True:
        wait = None if not held else max(held[0][0] - time.monotonic(), 0.0)
        readable, _, _ = select.select([sock], [], [], wait)
        if readable:
            while True:
                try:
                    data = sock.recv(1 << 16)
                except BlockingIOError:
                    break
                except OSError:  # ENOBUFS: messages were lost; their packets go with the next batch verdict
                    continue
                due = time.monotonic() + delay_s
                held.extend((due, pid) for pid in _packet_ids(data))
        now, last = time.monotonic(), None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            seq += 1
            verdict = _attr(_VERDICT_HDR, struct.pack("!II", _NF_ACCEPT, last))
            sock.send(_message(_MSG_VERDICT_BATCH, queue, verdict, seq, ack=False))


def main(argv: list[str] | None = None) -> int:
    from bimetal.args import ArgumentParser

    p = ArgumentParser(prog="python -m bimetal.lab.delay", description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, required=True, help="NFQUEUE queue number (the NIC's index)")
    p.add_argument("--delay-ms", type=float, required=True, help="how long each packet is held")
    args = p.parse_args(argv)
    if not _in_range(args.queue, args.delay_ms):
        p.error("--queue must be 0..65535 and --delay-ms in (0, 10000]")
    serve(args.queue, args.delay_ms / 1000)
    return 0


def _options(argv: list[str]) -> tuple[int, float] | None:
    """``--queue N --delay-ms D`` as ``start_delay`` writes them, with values ``main`` accepts; else None."""
    if len(argv) != 4 or argv[0] != "--queue" or argv[2] != "--delay-ms":
        return None
    try:
        queue, delay_ms = int(argv[1]), float(argv[3])
    except ValueError:
        return None
    return (queue, delay_ms) if _in_range(queue, delay_ms) else None


def _in_range(queue: int, delay_ms: float) -> bool:
    """What the daemon takes: an NFQUEUE number and a hold of at most ten seconds."""
    return 0 <= queue < 65536 and 0 < delay_ms <= 10_000


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run by its path: this package's folder is no place to find other modules
    options = _options(sys.argv[1:])
    if options is not None:
        serve(options[0], options[1] / 1000)
        sys.exit(0)
    from bimetal.entry import run_command

    sys.exit(run_command("lab delay", main, sys.argv[1:]))
