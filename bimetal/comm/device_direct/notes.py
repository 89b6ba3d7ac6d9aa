"""What device-direct peers tell each other, checked field by field before anything acts on it.

Two kinds of message cross between ranks, both JSON (never pickled):

* **start-up records** over the group's store: this rank's engine endpoint, the addresses of the receive
  pools it registered for each peer, its slot shape, its control-channel address, its host and its fabric
  (``check_record``);
* **notes** on the control channel (``control.py``), one per protocol step (``NOTE_FIELDS``): ``inline``,
  ``eager``, ``rts``, ``rtr``, ``nack``, ``fin`` and ``credit``, with the credits owed riding on any of them
  (``check_note``, which turns the wire dict into a ``Note``).

Anything else is refused with an error that names the message and what is wrong with it: a bad record fails
the group's set-up (``TransportError``); the proxy drops a bad note (``BadNote``) and logs why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bimetal.comm.base import TransportError

# note kind -> the integer fields it must carry
NOTE_FIELDS: dict[str, tuple[str, ...]] = {
    "inline": ("tag", "seq", "n"), "eager": ("tag", "seq", "slot", "n"), "rts": ("tag", "seq", "n"),
    "fin": ("tag", "seq"), "rtr": ("tag", "seq", "n", "addr"), "nack": ("tag", "seq", "n"), "credit": ()}


class BadNote(ValueError):
    """A control note that does not follow the protocol; the message says which field is wrong."""


@dataclass(frozen=True)
class Note:
    """One checked control note (``tag``/``seq`` are 0/-1 on credit notes, which belong to no message)."""

    kind: str
    tag: int = 0
    seq: int = -1
    n: int = 0
    """Message size in bytes (inline, eager, rts, rtr, nack)."""
    slot: int = -1
    """Receive slot the eager payload was written into."""
    addr: int = 0
    """Registered address of the receiver's tensor (rtr)."""
    credits: tuple[int, ...] = ()
    """Slots of ours the peer consumed and hands back."""
    payload: bytes = b""
    """The message itself (inline notes only)."""


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_note(raw: Any, payload: bytes, slots: int) -> Note:
    """``raw`` (the decoded JSON of one frame) and its ``payload`` as a ``Note``; raises ``BadNote``.

    ``slots`` is the number of receive slots per peer: credits and eager slots must name one of them."""
    if not isinstance(raw, dict):
        raise BadNote(f"a control note must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("k")
    if kind not in NOTE_FIELDS:
        raise BadNote(f"unknown control note kind {kind!r} (known: {', '.join(NOTE_FIELDS)})")
    fields = {}
    for name in NOTE_FIELDS[kind]:
        if not _whole(raw.get(name)):
            raise BadNote(f"{kind} note: field {name!r} must be an integer, got {raw.get(name)!r}")
        fields[name] = raw[name]
    if fields.get("n", 0) < 0:
        raise BadNote(f"{kind} note: size n must be >= 0, got {fields['n']}")
    if kind == "eager" and not 0 <= fields["slot"] < slots:
        raise BadNote(f"eager note: slot {fields['slot']} is not one of the {slots} receive slots")
    credits = raw.get("cr", [])
    if not isinstance(credits, list) or not all(_whole(c) and 0 <= c < slots for c in credits):
        raise BadNote(f"{kind} note: credits must be a list of slot numbers 0..{slots - 1}, got {credits!r}")
    want = fields["n"] if kind == "inline" else 0
    if len(payload) != want:  # a payload belongs to an inline note, and is exactly its size
        raise BadNote(f"{kind} note: carries a {len(payload)}-byte payload, expected {want}")
    return Note(kind, credits=tuple(credits), payload=payload, **fields)


def check_record(peer: int, record: Any) -> dict[str, Any]:
    """The start-up record group rank ``peer`` published, checked; raises ``TransportError`` naming the fault."""
    if not isinstance(record, dict) or not isinstance(record.get("ok"), bool):
        raise TransportError(f"malformed device-direct record from group rank {peer}: {record!r}")
    if record["ok"]:
        pools, ep = record.get("pools"), record.get("endpoint")
        shape = (record.get("chunk_bytes"), record.get("slots"))
        control = record.get("control")
        if not isinstance(control, dict) or not isinstance(control.get("host"), str) or not isinstance(
                control.get("port"), int) or not isinstance(control.get("token"), str):
            raise TransportError(f"malformed device-direct control address from group rank {peer}: {control!r}")
        if not isinstance(ep, dict) or not isinstance(pools, dict) or not all(isinstance(v, int) for v in shape):
            raise TransportError(f"malformed device-direct record from group rank {peer}: {record!r}")
        if not all(k.isdigit() and isinstance(v, int) and v > 0 for k, v in pools.items()):
            raise TransportError(f"malformed receive-pool addresses from group rank {peer}: {pools!r}")
        fabric = record.get("fabric")
        if not isinstance(record.get("host"), str) or not isinstance(fabric, dict) or not isinstance(
                fabric.get("protocol"), str) or not _fabric_devices(fabric.get("devices")) or not isinstance(
                fabric.get("gid", ""), str):
            raise TransportError(f"malformed device-direct host or fabric from group rank {peer}: "
                                 f"{record.get('host')!r}, {fabric!r}")
    elif not isinstance(record.get("reason"), str):
        raise TransportError(f"malformed device-direct record from group rank {peer}: {record!r}")
    return record


def _fabric_devices(devices: Any) -> bool:
    """A fabric's devices: device name -> list of link-layer names."""
    return isinstance(devices, dict) and all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v) for k, v in devices.items())
