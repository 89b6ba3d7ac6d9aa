"""One schema library, one transport table, one env reader, one store exchange: the shared mechanisms.

Every kind of file bimetal reads refuses an unknown key with one sentence naming the key and the file, through
the command that reads it (exit status 2, no traceback).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from bimetal.cli import main
from bimetal.errors import UserError
from bimetal.schema import SHAPE

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"
SPEC = ROOT / "configs" / "clusters" / "h200_mi325x.toml"
LAB = ROOT / "configs" / "lab" / "pair.toml"


def _edit(tmp: Path, source: Path, old: str, new: str, name: str = "bad.toml") -> str:
    text = source.read_text()
    assert old in text, f"{source} no longer contains {old!r}"
    path = tmp / name
    path.write_text(text.replace(old, new, 1))
    return str(path)


# (case id, argv builder, the key as the sentence names it)
CASES = [
    ("train-key", lambda t: ["train", "--config", _edit(t, DEMO, "seq_len = 128", "seq_lne = 128"),
                             "--simulate", "nvidia:1,amd:1"], "data.seq_lne"),
    ("train-section", lambda t: ["train", "--config", _edit(t, DEMO, "[data]", "[dat]"), "--simulate",
                                 "nvidia:1,amd:1"], "[dat]"),
    ("train-top-level", lambda t: ["train", "--config", _edit(t, DEMO, "[model]", "steps = 3\n[model]")], "'steps'"),
    ("plan-config-key", lambda t: ["plan", str(SPEC), "--config",
                                   _edit(t, ROOT / "configs" / "llama3-8b-h100-mi300x.toml", "[parallel]",
                                         "[parallel]\npipeline = 2")], "parallel.pipeline"),
    ("cluster-group-key", lambda t: ["plan", _edit(t, SPEC, "gpudirect = true", "gpudirekt = true"),
                                     "--model", "llama3-8b"], "'gpudirekt'"),
    ("cluster-top-key", lambda t: ["plan", _edit(t, SPEC, "[[group]]", "nics = 2\n[[group]]"),
                                   "--model", "llama3-8b"], "'nics'"),
    ("lab-node-key", lambda t: ["lab", "up", "--spec", _edit(t, LAB, "ranks = 2", "rank = 2")], "'rank'"),
    ("lab-table-key", lambda t: ["lab", "run", "--spec", _edit(t, LAB, "nics = 2", "nic = 2"), "--", "x.py"],
     "'lab.nic'"),
    ("lab-top-key", lambda t: ["lab", "up", "--spec", _edit(t, LAB, "[lab]", "[labs]")], "'labs'"),
]


@pytest.mark.parametrize(("build", "key"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_unknown_key_is_one_sentence_naming_key_and_file(build, key: str, tmp_path: Path, capsys, monkeypatch
                                                         ) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(name, raising=False)
    assert main(build(tmp_path)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "unknown" in err and key in err and str(tmp_path / "bad.toml") in err, err


def test_gpudirect_must_be_a_bool(tmp_path: Path, capsys) -> None:
    # bool("no") was True: a misspelt value switched GPUDirect on silently
    assert main(["plan", _edit(tmp_path, SPEC, "gpudirect = true", 'gpudirect = "no"'), "--model", "llama3-8b"]) == 2
    err = capsys.readouterr().err
    assert "group[0]: key 'gpudirect' must be a bool, got 'no'" in err and "bad.toml" in err


def test_wrong_types_are_named_with_the_file(tmp_path: Path) -> None:
    from bimetal.config import load_config

    for old, new, said in (("seq_len = 128", "seq_len = 128.0", "data.seq_len=128.0 in"),
                           ("seq_len = 128", "seq_len = true", "data.seq_len=True in"),
                           ("[3, 1]", '[3, "1"]', "parallel.layers_per_stage[1]='1' in")):
        with pytest.raises(UserError, match="should be a int") as info:
            load_config(_edit(tmp_path, DEMO, old, new))
        assert said in str(info.value) and "bad.toml" in str(info.value)
    cfg = load_config(_edit(tmp_path, DEMO, "seq_len = 128", 'seq_len = "64"'), ["--optim.lr=0.5"])
    assert (cfg.data.seq_len, cfg.optim.lr) == (64, 0.5)  # strings are read as the key's type, as before


@dataclass
class Inner:
    __pydantic_config__ = SHAPE
    width: int
    """How wide."""


@dataclass
class Outer:
    __pydantic_config__ = SHAPE
    inner: list[Inner] = field(default_factory=list)


def test_check_prefers_an_unknown_key_and_lists_the_known_ones() -> None:
    from bimetal.schema import check, descriptions

    with pytest.raises(UserError) as info:  # a missing 'width' is likelier explained by the misspelt 'widht'
        check(Outer, {"inner": [{"width": 1}, {"widht": 2}]}, "f.json")
    assert str(info.value) == "f.json: unknown key 'inner[1].widht'; known keys: width."
    with pytest.raises(UserError, match=r"f.json: key 'inner\[0\].width' input should be a valid integer, got 'x'"):
        check(Outer, {"inner": [{"width": "x"}]}, "f.json")
    assert descriptions(Inner) == {"width": "How wide."}


def test_one_transport_table() -> None:
    from bimetal import transports
    from bimetal.comm import registry
    from bimetal.config import ParallelConfig
    from bimetal.parallel.groups import resolve_transports

    assert transports.NAMES == ("cpu-forward", "device-direct", "gloo")
    assert {t.backend: t.module for t in transports.TABLE if t.module} == registry._TRANSPORT_MODULES
    p = ParallelConfig()
    assert p.pp_transport == p.dp_transport == transports.DEFAULT  # one default for pp and dp
    assert resolve_transports(None) == {"pp": registry.CPU_FORWARD, "dp": registry.CPU_FORWARD}


def test_env_readers_apply_the_table(monkeypatch) -> None:
    from bimetal import env

    monkeypatch.setenv("BIMETAL_CF_POOL_BUFFERS", "1")
    with pytest.raises(UserError, match="BIMETAL_CF_POOL_BUFFERS='1' is not valid"):
        env.read_int("BIMETAL_CF_POOL_BUFFERS", 8)
    monkeypatch.setenv("BIMETAL_CF_POOL_BUFFERS", "4")
    assert env.read_int("BIMETAL_CF_POOL_BUFFERS", 8) == 4
    monkeypatch.delenv("BIMETAL_CF_POOL_BUFFERS")
    assert env.read_int("BIMETAL_CF_POOL_BUFFERS", 8) == 8
    monkeypatch.setenv("BIMETAL_TRACEBACK", "1")
    assert env.read_flag("BIMETAL_TRACEBACK")
    with pytest.raises(KeyError):  # a variable not in the table cannot be read
        env.read("BIMETAL_NOT_LISTED")


def test_store_exchange_names_the_rank_of_a_bad_record() -> None:
    import torch.distributed as dist

    from bimetal.topology import store_exchange
    from bimetal.topology.exchange import exchange_topology
    from bimetal.topology.records import RankRecord, TopologyError

    store = dist.HashStore()
    rec = RankRecord(rank=1, local_rank=0, host="b", vendor="amd", device="cpu", memory_bytes=0)
    store_exchange.publish(store, "t", 1, json.loads(rec.to_json()) | {"gpudirekt": True})
    with pytest.raises(TopologyError, match="topology record of rank 1: field 'gpudirekt' is not a known field"):
        exchange_topology(store, 0, 2, timedelta(seconds=5), RankRecord(0, 0, "a", "nvidia", "cpu", 0), prefix="t")
    store_exchange.publish(store, "t", 1, json.loads(rec.to_json()))
    view = exchange_topology(store, 0, 2, timedelta(seconds=5), RankRecord(0, 0, "a", "nvidia", "cpu", 0), prefix="t")
    assert view.vendors == ["nvidia", "amd"] and view[1] == rec
    with pytest.raises(TopologyError, match="rank 2 did not publish"):
        exchange_topology(store, 0, 3, timedelta(seconds=0.2), RankRecord(0, 0, "a", "nvidia", "cpu", 0), prefix="t")


def test_unknown_key_in_a_profile_record_is_named_through_plan(tmp_path: Path, capsys) -> None:
    (tmp_path / "cpu.json").write_text(json.dumps({"achieved_flops": 1e10, "achived_flops": 1e10}))
    group = ('[[group]]\nvendor = "cpu"\ngpu = "cpu"\ngpus_per_node = 1\nnics_per_node = 1\nnic_gbps = 1.0\n'
             'intra_gbps = 1.0\nmemory_gb = 4.0\nprofile = "cpu.json"\n')
    (tmp_path / "lab.toml").write_text(group + group)
    assert main(["plan", str(tmp_path / "lab.toml"), "--model", "debug"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'achived_flops'" in err and str(tmp_path / "cpu.json") in err and "group[0]" in err, err


def test_poll_gives_none_for_a_rank_that_does_not_report() -> None:
    import torch.distributed as dist

    from bimetal.topology import store_exchange

    store = dist.HashStore()
    store_exchange.publish(store, "diag", 1, {"op": "send", "seq": 3})
    store.set("diag/3", b"\x80pickle")
    got = store_exchange.poll(store, "diag", [1, 2, 3], timedelta(seconds=0.2),
                              decode=lambda v, r: (str(v["op"]), int(v["seq"])))
    assert got == {1: ("send", 3), 2: None, 3: None}
