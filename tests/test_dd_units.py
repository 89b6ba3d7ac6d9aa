"""Device-direct pieces on their own, no engine and no second process: note validation and the options."""

from __future__ import annotations

import logging
from unittest import mock

import pytest

from bimetal.comm.base import TransportError
from bimetal.comm.device_direct import DeviceDirectOptions, DeviceDirectSettings, EngineUnavailableError, options_from
from bimetal.comm.device_direct.engine import Engine
from bimetal.comm.device_direct.notes import BadNote, Note, check_note, check_record
from bimetal.errors import UserError

pytestmark = pytest.mark.timeout(60)
SLOTS = 8


# -- notes ---------------------------------------------------------------------------------------------------

def test_good_notes_become_notes_with_their_fields() -> None:
    assert check_note({"k": "inline", "tag": 3, "seq": 1, "n": 2}, b"ab", SLOTS) == Note(
        "inline", tag=3, seq=1, n=2, payload=b"ab")
    eager = check_note({"k": "eager", "tag": 0, "seq": 5, "slot": 7, "n": 100, "cr": [0, 1]}, b"", SLOTS)
    assert (eager.kind, eager.slot, eager.n, eager.credits) == ("eager", 7, 100, (0, 1))
    rtr = check_note({"k": "rtr", "tag": 1, "seq": 0, "n": 9 << 20, "addr": 1234}, b"", SLOTS)
    assert (rtr.addr, rtr.n) == (1234, 9 << 20)
    credit = check_note({"k": "credit", "cr": [3]}, b"", SLOTS)
    assert (credit.tag, credit.seq, credit.credits) == (0, -1, (3,))  # belongs to no message
    assert check_note({"k": "fin", "tag": 2, "seq": 4, "extra": "ignored"}, b"", SLOTS).kind == "fin"


@pytest.mark.parametrize(("raw", "payload", "says"), [
    (["k", "fin"], b"", "must be a JSON object"),
    ({"k": "hello", "tag": 0, "seq": 0}, b"", "unknown control note kind 'hello'"),
    ({"tag": 0, "seq": 0}, b"", "unknown control note kind None"),
    ({"k": "fin", "tag": 0}, b"", "fin note: field 'seq' must be an integer, got None"),
    ({"k": "fin", "tag": "0", "seq": 0}, b"", "field 'tag' must be an integer, got '0'"),
    ({"k": "rts", "tag": 0, "seq": True, "n": 4}, b"", "field 'seq' must be an integer, got True"),
    ({"k": "rtr", "tag": 0, "seq": 0, "n": -1, "addr": 8}, b"", "size n must be >= 0, got -1"),
    ({"k": "eager", "tag": 0, "seq": 0, "slot": SLOTS, "n": 4}, b"", f"slot {SLOTS} is not one of the {SLOTS}"),
    ({"k": "eager", "tag": 0, "seq": 0, "slot": -1, "n": 4}, b"", "slot -1 is not one of"),
    ({"k": "credit", "cr": [SLOTS]}, b"", "credits must be a list of slot numbers 0..7, got [8]"),
    ({"k": "credit", "cr": 3}, b"", "credits must be a list"),
    ({"k": "inline", "tag": 0, "seq": 0, "n": 4}, b"abc", "carries a 3-byte payload, expected 4"),
    ({"k": "fin", "tag": 0, "seq": 0}, b"x", "fin note: carries a 1-byte payload, expected 0"),
])
def test_bad_notes_are_refused_naming_the_fault(raw: object, payload: bytes, says: str) -> None:
    with pytest.raises(BadNote) as caught:
        check_note(raw, payload, SLOTS)
    assert says in str(caught.value)


def _record(**changes: object) -> dict:
    record = {"ok": True, "endpoint": {"session": "h:1"}, "pools": {"1": 4096}, "chunk_bytes": 1024, "slots": 8,
              "inline": 0, "control": {"host": "127.0.0.1", "port": 5, "token": "t"}, "host": "node1",
              "fabric": {"protocol": "rdma", "devices": {"mlx5_0": ["InfiniBand"]}}}
    record.update(changes)
    return record


def test_start_up_records_are_checked_naming_the_rank() -> None:
    assert check_record(3, _record())["pools"] == {"1": 4096}
    assert check_record(3, {"ok": False, "reason": "no engine"})["reason"] == "no engine"
    for bad, says in [("nonsense", "malformed device-direct record from group rank 3"),
                      (_record(control={"host": "h", "port": "5", "token": "t"}), "malformed device-direct control"),
                      (_record(pools={"x": 4096}), "malformed receive-pool addresses from group rank 3"),
                      (_record(pools={"1": 0}), "malformed receive-pool addresses"),
                      (_record(slots="8"), "malformed device-direct record"),
                      (_record(fabric={"protocol": "rdma", "devices": {"mlx5_0": "IB"}}), "host or fabric"),
                      (_record(host=None), "malformed device-direct host or fabric from group rank 3"),
                      ({"ok": False}, "malformed device-direct record")]:
        with pytest.raises(TransportError, match=says):
            check_record(3, bad)


def test_the_proxy_drops_a_bad_note_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    from bimetal.comm.device_direct.proxy import Proxy

    proxy = Proxy(mock.MagicMock(spec=Engine), 0, [10, 11], chunk=1024, slots=SLOTS, host="127.0.0.1")
    try:
        proxy.connect(1, {}, 4096)
        frames = [(1, {"k": "eager", "tag": 0, "seq": 0, "slot": 99, "n": 4}, b""),
                  (1, {"k": "inline", "tag": 0, "seq": 0, "n": 1}, b"z"),
                  (2, {"k": "inline", "tag": 0, "seq": 1, "n": 1}, b"z")]  # not a connected peer: ignored
        with mock.patch.object(proxy.control, "take", return_value=frames), caplog.at_level(logging.WARNING):
            assert proxy._take_notes()
        assert list(proxy.transfers.arrived) == [(1, 0, 0)]
        assert proxy.transfers.arrived[(1, 0, 0)].payload == b"z"
        assert "dropped a control note from peer rank 11 (group rank 1): eager note: slot 99" in caplog.text
    finally:
        proxy.close()


# -- options -------------------------------------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HOST", "PROTOCOL", "ENGINE", "CHUNK_BYTES", "SLOTS", "WINDOW", "INLINE_BYTES", "FALLBACK", "DEVICE",
                 "DEVICES", "REG_CACHE_BYTES"):
        monkeypatch.delenv(f"BIMETAL_DD_{name}", raising=False)
    monkeypatch.setenv("BIMETAL_DD_HOST", "127.0.0.1")
    return monkeypatch


def test_options_precedence_pg_options_then_env_then_defaults(clean_env: pytest.MonkeyPatch) -> None:
    assert options_from(None) == DeviceDirectSettings(host="127.0.0.1")
    clean_env.setenv("BIMETAL_DD_WINDOW", "4")
    clean_env.setenv("BIMETAL_DD_FALLBACK", "CPU-Forward")
    clean_env.setenv("BIMETAL_DD_DEVICE", "cpu")
    got = options_from({"window": 2, "slots": 3})
    assert (got.window, got.slots, got.fallback, got.device) == (2, 3, "cpu-forward", "cpu")
    assert options_from(None).window == 4
    typed = options_from(DeviceDirectOptions(chunk_bytes=1 << 16, inline_bytes=0, protocol="tcp"))
    assert (typed.chunk_bytes, typed.inline_bytes, typed.protocol, typed.window) == (1 << 16, 0, "tcp", 4)
    assert DeviceDirectOptions.from_pg_options({"host": "10.0.0.2"}) == DeviceDirectOptions(host="10.0.0.2")


@pytest.mark.parametrize(("given", "says"), [
    ({"windw": 4}, "unknown device-direct option 'windw' in pg_options; the options are host, protocol"),
    ({"window": "many"}, "option window must be an integer >= 1, got 'many' (BIMETAL_DD_WINDOW)"),
    ({"slots": True}, "option slots must be an integer >= 1, got True"),
    ({"chunk_bytes": 1.5}, "option chunk_bytes must be an integer >= 1, got 1.5"),
    ({"inline_bytes": -1}, "option inline_bytes must be between 0 and 262144, got -1"),
    (DeviceDirectOptions(window=0), "option window must be an integer >= 1, got 0"),
    ({"fallback": "retry"}, "unknown device-direct fallback 'retry'; set BIMETAL_DD_FALLBACK to error or cpu-forward"),
    ([("window", 4)], "pg_options must be a DeviceDirectOptions or a dict of its fields, got a list"),
])
def test_bad_options_are_refused_in_one_sentence_naming_them(clean_env: pytest.MonkeyPatch, given: object,
                                                               says: str) -> None:
    with pytest.raises(EngineUnavailableError) as caught:
        options_from(given)
    assert isinstance(caught.value, UserError)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_env_value_is_refused_naming_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("BIMETAL_DD_SLOTS", "eight")
    with pytest.raises(EngineUnavailableError, match=r"^BIMETAL_DD_SLOTS='eight' is not valid; set it to an integer"):
        options_from(None)


def test_engine_bounce_is_staging_and_told_apart() -> None:
    """Device memory that Mooncake's TCP transport copies through the host is staged bytes (the user sees it in
    bytes_staged), and bytes_engine_bounced says how much of the staging was the engine's, not bimetal's."""
    from bimetal.comm.device_direct.ops import Counters

    c = Counters()
    c.staged_bytes += 7  # e.g. a CPU receive pool feeding a GPU tensor: bimetal's own staging
    c.engine_bounce(1 << 20)
    stats = c.stats()
    assert stats["bytes_staged"] == 7 + (1 << 20) and stats["bytes_engine_bounced"] == 1 << 20, stats
