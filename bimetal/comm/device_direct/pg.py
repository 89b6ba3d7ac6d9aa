"""``bimetal_device_direct``: the process group whose point-to-point data moves by one-sided engine writes.

The training thread only enqueues (``send``/``recv`` return a Work at once); the proxy thread (``proxy.py``)
owns the engine. Endpoint metadata, receive-pool addresses, the control-channel address, the host and the fabric
are exchanged over the group's store as JSON, validated field by field; then the proxies open their control
connections and every rank writes once to every peer through the engine (``probe.py``): the ranks agree on the
outcome over the store, and a failure anywhere raises ``ProbeFailedError`` on every rank (the creator applies the
fallback policy to it). A registration the engine refuses while the group is set up (its receive slots, its send
pool) is published in place of the rank's record, so every rank learns it at once and raises the same
``GroupStartError`` (the fallback policy again), instead of the others waiting out the store's timeout.
Pipeline parallelism needs send/recv/isend/irecv/batch_isend_irecv; the few collectives the trainer runs on a
pp group (loss broadcast, grad-norm all-reduce, barrier) are built from the same point-to-point messages with
reserved tags.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bimetal.comm.base import BimetalProcessGroup, OpRecord, TransportError, completed_work, make_work
from bimetal.comm.device_direct.engine import Engine, GroupStartError, RegistrationError, verbs_devices
from bimetal.comm.device_direct.notes import check_record
from bimetal.comm.device_direct.options import DeviceDirectSettings
from bimetal.comm.device_direct.probe import PROBE_BYTES, PROBE_S, ProbeFailedError, Side, local_fabric, probe_peers
from bimetal.comm.device_direct.proxy import Proxy
from bimetal.topology import store_exchange
from bimetal.topology.exchange import host_identity

_BCAST_TAG, _REDUCE_TAG, _BARRIER_TAG = -1, -2, -3  # user tags are >= 0, so collectives never steal a message
_REDUCE = {dist.ReduceOp.SUM: torch.Tensor.add_, dist.ReduceOp.AVG: torch.Tensor.add_,
           dist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a), dist.ReduceOp.MIN: lambda a, b: torch.minimum(
               a, b, out=a), dist.ReduceOp.PRODUCT: torch.Tensor.mul_}


def _publish(store: dist.Store, rank: int, record: dict[str, Any]) -> None:
    store_exchange.publish(store, "bimetal_dd", rank, record)


def _read(store: dist.Store, peer: int) -> dict[str, Any]:
    return store_exchange.gather(store, "bimetal_dd", [peer], decode=lambda value, r: check_record(r, value))[0]


class DeviceDirectProcessGroup(BimetalProcessGroup):
    """Point-to-point over a transfer engine through a CPU proxy thread; see the module docstring."""

    backend_name = "bimetal_device_direct"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, global_ranks: list[int],
                 engine: Engine, opts: DeviceDirectSettings, device: torch.device) -> None:
        super().__init__(rank, size, timeout, global_ranks)
        self.engine_name, self.protocol = engine.name, engine.protocol
        peers = [p for p in range(size) if p != rank]
        me = Side(self.global_ranks[rank], host_identity(),
                  local_fabric(engine.protocol, opts.devices, verbs_devices() if engine.protocol != "tcp" else []))
        proxy: Proxy | None = None
        try:
            proxy = Proxy(engine, rank, self.global_ranks, opts.chunk_bytes, opts.slots, opts.window,
                          timeout.total_seconds(), device, opts.inline_bytes, opts.host, opts.reg_cache_bytes)
            pools = {str(p): proxy.add_peer(p) for p in peers}
            mine: dict[str, Any] = {
                "ok": True, "endpoint": engine.endpoint(), "pools": pools, "chunk_bytes": opts.chunk_bytes,
                "slots": opts.slots, "inline": opts.inline_bytes, "control": proxy.control.address, "host": me.host,
                "fabric": me.fabric}
        except RegistrationError as exc:
            # told to the others at once (they would otherwise wait for this record until the store's timeout)
            mine = {"ok": False, "reason": f"global rank {me.rank} on {me.host}: {exc}"}
        _publish(store, rank, mine)
        records = {p: _read(store, p) for p in peers}
        records[rank] = mine
        failed = next((r["reason"] for _, r in sorted(records.items()) if not r["ok"]), None)
        if failed is not None or proxy is None:  # every rank saw every record: all take the first failure alike
            if proxy is not None:
                proxy.close()
            else:
                engine.close()
            raise GroupStartError(f"the device-direct group could not start on {failed}")
        self.proxy = proxy
        controls, sides = {}, {}
        for p in peers:
            record = records[p]
            theirs = (record["chunk_bytes"], record["slots"], record.get("inline"))
            mine_shape = (opts.chunk_bytes, opts.slots, opts.inline_bytes)
            if theirs != mine_shape:
                raise TransportError(f"group rank {p} uses device-direct chunk/slots/inline "
                                     f"{'/'.join(map(str, theirs))} but this rank {'/'.join(map(str, mine_shape))}; "
                                     "set the same BIMETAL_DD_CHUNK_BYTES/_SLOTS/_INLINE_BYTES on every rank")
            if str(rank) not in record["pools"]:
                raise TransportError(f"group rank {p} published no receive pool for group rank {rank}")
            self.proxy.connect(p, record["endpoint"], record["pools"][str(rank)])
            controls[p] = record["control"]
            sides[p] = (Side(self.global_ranks[p], record["host"], record["fabric"]), record["pools"][str(rank)])
        self.proxy.control.connect(controls, timeout.total_seconds())
        self._probe(store, rank, size, me, sides, min(PROBE_S, timeout.total_seconds()))
        self.proxy.start()
        # backstop: the proxy never outlives the group, not even when nobody calls destroy_process_group
        self._finalizer = weakref.finalize(self, Proxy.close, self.proxy)
        atexit.register(self._finalizer)
        self._lock = threading.Lock()

    def _probe(self, store: dist.Store, rank: int, size: int, me: Side, sides: dict[int, tuple[Side, int]],
               deadline_s: float) -> None:
        """One write to every peer, then every rank learns every outcome; any failure fails all (same sentence)."""
        pools = self.proxy.transfers.pools
        failure = probe_peers(self.proxy.engine, me, sides, {p: pools[p].data_ptr() for p in sides}, deadline_s,
                              min(PROBE_BYTES, self.proxy.chunk * self.proxy.nslots))
        outcomes: list[str] = store_exchange.exchange(store, "bimetal_dd_probe", rank, failure or "ok", range(size))
        failed = next((why for why in outcomes if why != "ok"), None)
        if failed is not None:
            self.proxy.close()
            raise ProbeFailedError(failed)

    def device_report(self) -> dict[str, str]:
        """Where each buffer, stream and registration of the group is: buffer name -> device, and the location
        names the engine was given (the GPU check's row; all should be this rank's device)."""
        report = dict(self.proxy.transfers.registrations.buffers)
        report["copy stream"] = str(self.proxy.transfers.stream_device)
        report["engine locations"] = ",".join(sorted(self.proxy.transfers.registrations.locations))
        return report

    # -- point to point -----------------------------------------------------------------------------------

    def _p2p(self, rec: OpRecord, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        if len(tensors) != 1:
            raise self.unsupported(kind, f"{len(tensors)} tensors (exactly one is supported)")
        (tensor,) = tensors
        if not 0 <= peer < self._size or peer == self._rank:
            raise TransportError(f"{rec.describe()}: peer must be another group rank (0..{self._size - 1})")
        if not tensor.is_contiguous():
            raise self.unsupported(kind, "a non-contiguous tensor")
        return make_work(self._submit(rec, kind, tensor, peer, tag))

    def _submit(self, rec: OpRecord, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> torch.futures.Future:
        fut = (self.proxy.send if kind == "send" else self.proxy.recv)(tensor, peer, tag, rec.describe())
        nbytes = tensor.numel() * tensor.element_size()

        def account(f: torch.futures.Future) -> list[torch.Tensor]:
            f.value()  # re-raises the proxy's error
            if kind == "send":
                self.counters.add(bytes_sent=nbytes)
            else:
                self.counters.add(bytes_received=nbytes)
            return [tensor]

        return fut.then(account)

    # (the base's template method has begun the op and checked the dtypes: ``bimetal.comm.base``)
    def _do_send(self, rec: OpRecord, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        return self._p2p(rec, "send", tensors, peer, tag)

    def _do_recv(self, rec: OpRecord, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        return self._p2p(rec, "recv", tensors, peer, tag)

    # -- the few collectives a pp group sees, over point to point -------------------------------------------

    def _wait(self, rec: OpRecord, futs: list[torch.futures.Future]) -> None:
        for f in futs:
            f.wait()

    def _do_broadcast(self, rec: OpRecord, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        root = getattr(opts, "rootRank", 0)
        with self._lock:
            for t in tensors:
                if self._rank == root:
                    self._wait(rec, [self._submit(rec, "send", t, p, _BCAST_TAG) for p in range(self._size)
                                     if p != root])
                else:
                    self._wait(rec, [self._submit(rec, "recv", t, root, _BCAST_TAG)])
        return completed_work(tensors)

    def _do_allreduce(self, rec: OpRecord, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        reduce = next((fn for k, fn in _REDUCE.items() if op == k), None)
        if reduce is None:
            raise self.unsupported("all_reduce", f"reduce op {op}")
        with self._lock:
            for t in tensors:
                if self._rank == 0:  # gather to group rank 0 in rank order (deterministic), reduce, send back
                    parts = [torch.empty_like(t) for _ in range(1, self._size)]
                    self._wait(rec, [self._submit(rec, "recv", b, p + 1, _REDUCE_TAG) for p, b in enumerate(parts)])
                    for b in parts:
                        reduce(t, b)
                    if op == dist.ReduceOp.AVG:
                        t.div_(self._size)
                    self._wait(rec, [self._submit(rec, "send", t, p, _REDUCE_TAG) for p in range(1, self._size)])
                else:
                    self._wait(rec, [self._submit(rec, "send", t, 0, _REDUCE_TAG)])
                    self._wait(rec, [self._submit(rec, "recv", t, 0, _REDUCE_TAG)])
        return completed_work(tensors)

    def _do_barrier(self, rec: OpRecord, opts: Any) -> dist.Work:
        token = torch.zeros(1, dtype=torch.int32, device=self.proxy.device)
        with self._lock:
            if self._rank == 0:
                self._wait(rec, [self._submit(rec, "recv", torch.empty_like(token), p, _BARRIER_TAG)
                                 for p in range(1, self._size)])
                self._wait(rec, [self._submit(rec, "send", token, p, _BARRIER_TAG) for p in range(1, self._size)])
            else:
                self._wait(rec, [self._submit(rec, "send", token, 0, _BARRIER_TAG)])
                self._wait(rec, [self._submit(rec, "recv", token, 0, _BARRIER_TAG)])
        return completed_work(None)

    # -- life cycle and counters ----------------------------------------------------------------------------

    def comm_stats(self) -> dict[str, int]:
        """The base counters with the proxy's staged/direct split (staging happens only where the engine or a
        CPU receive pool bounces GPU memory through the host; on RDMA, or on CPU tensors, it is 0)."""
        stats = self.counters.snapshot()
        stats.update(self.proxy.counters.stats())
        return stats

    @property
    def proxy_alive(self) -> bool:
        return self.proxy.alive

    def shutdown(self) -> None:  # type: ignore[override]
        super().shutdown()
        self._finalizer()  # joins the proxy thread, releases registered memory and the engine
