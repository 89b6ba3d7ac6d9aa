"""Publish mine, gather everyone's: small JSON records over the c10d store, the control plane of every group.

The topology exchange, the native back-end's vendor handshake, the device-direct engine addresses and the
transports' diagnostics all move the same way: a rank writes one JSON value under ``<prefix>/<rank>`` and
reads the values of the ranks it needs, waiting up to a timeout. Values are JSON, never pickle, and each one
is decoded by the caller's ``decode`` (typically ``bimetal.schema.check`` against a record shape) with the
publisher's rank, so a bad record is refused naming the rank that sent it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from bimetal.errors import UserError

T = TypeVar("T")
T_K = TypeVar("T_K", int, str)


def key_of(prefix: str, rank: int | str) -> str:
    """The store key of ``rank``'s value under ``prefix`` (a rank, or a name such as a group's)."""
    return f"{prefix}/{rank}"


def publish(store: dist.Store, prefix: str, rank: int | str, value: Any) -> None:
    """Write ``value`` (JSON-serialisable) as ``rank``'s record under ``prefix``."""
    store.set(key_of(prefix, rank), json.dumps(value, sort_keys=True))


def _no_decode(value: Any, rank: Any) -> Any:
    return value


def gather(store: dist.Store, prefix: str, ranks: Iterable[T_K], timeout: timedelta | None = None,
           decode: Callable[[Any, T_K], T] = _no_decode,  # type: ignore[assignment]
           missing: Callable[[T_K, BaseException], Exception] | None = None,
           not_json: Callable[[T_K, BaseException], Exception] | None = None) -> list[T]:
    """The records of ``ranks`` under ``prefix``, in that order, each decoded by ``decode(value, rank)``.

    ``timeout`` (if given) becomes the store's timeout for the waits. A rank that has not published in time
    raises ``missing(rank, error)`` (default: the store's own error); text that is not JSON raises
    ``not_json(rank, error)`` (default: ``ValueError`` naming the rank and the key).
    """
    if timeout is not None:
        store.set_timeout(timeout)
    out = []
    for r in ranks:
        try:
            raw = store.get(key_of(prefix, r))
        except (RuntimeError, dist.DistStoreError) as exc:
            if missing is None:
                raise
            raise missing(r, exc) from exc
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            if not_json is None:
                raise ValueError(f"the record of rank {r} under {key_of(prefix, r)} is not JSON ({exc})") from None
            raise not_json(r, exc) from None
        out.append(decode(value, r))
    return out


def exchange(store: dist.Store, prefix: str, rank: int, value: Any, ranks: Iterable[int],
             timeout: timedelta | None = None, decode: Callable[[Any, int], T] = _no_decode,  # type: ignore[assignment]
             missing: Callable[[int, BaseException], Exception] | None = None,
             not_json: Callable[[int, BaseException], Exception] | None = None) -> list[T]:
    """``publish`` this rank's ``value``, then ``gather`` the records of ``ranks`` (this rank's included if
    listed)."""
    publish(store, prefix, rank, value)
    return gather(store, prefix, ranks, timeout, decode, missing, not_json)


def poll(store: dist.Store, prefix: str, ranks: Iterable[int], wait: timedelta,
         decode: Callable[[Any, int], T] = _no_decode) -> dict[int, T | None]:  # type: ignore[assignment]
    """Best effort, for diagnostics after a failure: each of ``ranks``' records if it appears within ``wait``
    (the store's own timeout is left as it is), else None, as it is for a record that is not JSON or that
    ``decode`` refuses (``ValueError``, ``KeyError``, ``TypeError`` or ``UserError``).

    It asks with ``check`` until the time is up rather than ``wait``: a wait that times out makes torch print two
    warning lines, and a record that never comes (a dead peer's) is what this is for."""
    out: dict[int, T | None] = {}
    missing = list(ranks)
    deadline = time.monotonic() + wait.total_seconds()
    while True:
        for r in list(missing):
            try:
                if not store.check([key_of(prefix, r)]):
                    continue
                out[r] = decode(json.loads(store.get(key_of(prefix, r))), r)
            except (RuntimeError, dist.DistStoreError, ValueError, KeyError, TypeError, UserError):
                out[r] = None
            missing.remove(r)
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for r in missing:
        out[r] = None
    return out
