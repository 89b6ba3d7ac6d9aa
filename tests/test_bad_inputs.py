"""The catalogue of bad inputs: each one ends with one clear sentence and exit status 2, no traceback.

Command-line cases run ``bimetal.cli.main`` in this process (nothing is launched: every case fails while
checking its input). Records that arrive over the network are checked at the function that parses them,
whose error type is the ``UserError`` the CLI turns into exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bimetal.cli import main
from bimetal.errors import UserError
from bimetal.topology.records import NicInfo, RankRecord

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"
SPEC = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "h200_mi325x.toml"


def _write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _demo_with(tmp: Path, old: str, new: str) -> str:
    text = DEMO.read_text()
    assert old in text, f"demo config no longer contains {old!r}"
    return _write(tmp, "cfg.toml", text.replace(old, new, 1))


def _spec_with(tmp: Path, old: str, new: str) -> str:
    text = SPEC.read_text()
    assert old in text, f"cluster spec no longer contains {old!r}"
    return _write(tmp, "spec.toml", text.replace(old, new, 1))


# (case id, argv builder taking tmp_path, fragment the message must contain)
CLI_CASES = [
    ("unknown-command", lambda t: ["frobnicate"], "unknown command 'frobnicate'"),
    ("no-bench", lambda t: ["bench", "nothing"], "usage: bimetal bench"),
    # train: config files
    ("config-missing", lambda t: ["train", "--config", str(t / "nope.toml")], "does not exist"),
    ("config-not-toml", lambda t: ["train", "--config", _write(t, "c.toml", "[model\nfamily=")], "not valid TOML"),
    ("config-unknown-section", lambda t: ["train", "--config", _write(t, "c.toml", "[modle]\nfamily='llama3'\n")],
     "unknown config section [modle]"),
    ("config-unknown-key", lambda t: ["train", "--config", _demo_with(t, "seq_len = 128", "seq_lne = 128")],
     "unknown config key data.seq_lne"),
    ("config-wrong-type", lambda t: ["train", "--config", _demo_with(t, "seq_len = 128", "seq_len = 'long'")],
     "data.seq_len"),
    ("config-bad-split", lambda t: ["train", "--config", _demo_with(t, "[3, 1]", "[3, 3]")], "layers_per_stage"),
    ("config-empty-stage", lambda t: ["train", "--config", _demo_with(t, "[3, 1]", "[4, 0]")], "no layers"),
    ("config-bad-schedule", lambda t: ["train", "--config", _demo_with(t, '"1f1b"', '"zigzag"')],
     "schedule='zigzag' is unknown"),
    ("config-bad-dtype", lambda t: ["train", "--config", _demo_with(t, 'dtype = "auto"', 'dtype = "fp8"')],
     "training.dtype='fp8' is unknown"),
    ("config-zero-pp", lambda t: ["train", "--config", _demo_with(t, "pp = 2", "pp = 0")], "must both be at least 1"),
    ("config-batch-not-multiple", lambda t: ["train", "--config", _demo_with(t, "batch_size = 8", "batch_size = 7")],
     "data.batch_size=7 must be a multiple"),
    ("override-unknown-key", lambda t: ["train", "--config", str(DEMO), "--optim.learning_rate=1"],
     "unknown config key optim.learning_rate"),
    ("override-no-value", lambda t: ["train", "--config", str(DEMO), "--optim.lr"], "has no value"),
    ("override-bad-value", lambda t: ["train", "--config", str(DEMO), "--training.steps=many"], "training.steps"),
    ("override-not-override", lambda t: ["train", "--config", str(DEMO), "stray"], "is not an override"),
    ("tokenizer-not-json", lambda t: ["train", f"--data.tokenizer={_write(t, 'tok.json', 'hello')}"],
     "is not a tokenizers JSON file"),
    ("optim-beta-one", lambda t: ["train", "--optim.beta2=1"], "optim.beta2=1.0"),
    ("log-every-zero", lambda t: ["train", "--metrics.log_every=0"], "metrics.log_every=0"),
    # plan: cluster specs and model names
    ("spec-missing", lambda t: ["plan", str(t / "none.toml"), "--model", "llama3-8b"], "not found"),
    ("spec-not-toml", lambda t: ["plan", _write(t, "s.toml", "[[group]\n"), "--model", "llama3-8b"],
     "not valid TOML"),
    ("spec-no-group", lambda t: ["plan", _write(t, "s.toml", "title = 'x'\n"), "--model", "llama3-8b"],
     "key 'group' missing"),
    ("spec-bad-vendor", lambda t: ["plan", _spec_with(t, 'vendor = "amd"', 'vendor = "intel"'), "--model",
                                   "llama3-8b"], "key 'vendor' must be 'nvidia', 'amd' or 'cpu'"),
    ("spec-unknown-gpu", lambda t: ["plan", _spec_with(t, 'gpu = "MI325X"', 'gpu = "MI999"'), "--model",
                                    "llama3-8b"], "not in the device table"),
    ("spec-negative-count", lambda t: ["plan", _spec_with(t, "count = 1", "count = -1"), "--model", "llama3-8b"],
     "must be positive"),
    ("spec-missing-key", lambda t: ["plan", _spec_with(t, "nics_per_node = 8\n", ""), "--model", "llama3-8b"],
     "missing key 'nics_per_node'"),
    ("spec-wrong-type", lambda t: ["plan", _spec_with(t, "nic_gbps = 400", "nic_gbps = 'fast'"), "--model",
                                   "llama3-8b"], "key 'nic_gbps' must be"),
    # topo / launch: CLI arguments
    ("simulate-bad-vendor", lambda t: ["topo", "--simulate", "intel:2"], "bad simulation entry 'intel:2'"),
    ("simulate-bad-count", lambda t: ["topo", "--simulate", "nvidia:0"], "bad simulation entry 'nvidia:0'"),
    ("simulate-no-count", lambda t: ["launch", "--simulate", "nvidia", "--", "x.py"], "bad simulation entry"),
    ("topo-no-simulate", lambda t: ["topo"], "give --simulate"),
    ("launch-nothing", lambda t: ["launch", "--simulate", "nvidia:1,amd:1"], "nothing to launch"),
]


@pytest.mark.parametrize(("build", "fragment"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(build, fragment: str, tmp_path: Path, capsys, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    code = main(build(tmp_path))
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err, err
    assert "Traceback" not in err
    message = [line for line in err.splitlines() if line.strip()]
    assert len(message) <= 12 and message[0].startswith("bimetal"), err


def _record_payload(**changes) -> str:
    payload = json.loads(RankRecord(rank=0, local_rank=0, host="node0", vendor="nvidia", device="NVIDIA H200",
                                    memory_bytes=1, nics=(NicInfo("eth0", "10.0.0.1", 24),)).to_json())
    payload.update(changes)
    return json.dumps(payload)


RECORD_CASES = [
    ("record-pickle", b"\x80\x04\x95pickled", "is not valid JSON"),
    ("record-list", "[]", "is a list"),
    ("record-vendor", _record_payload(vendor="intel"), "'vendor'"),
    ("record-rank-lie", _record_payload(rank=3), "'rank' says 3"),
    ("record-extra", _record_payload(exec="import os"), "'exec' is not a known field"),
    ("record-bad-ip", _record_payload(nics=[{"name": "eth0", "address": "999.1.1.1", "prefix": 24}]),
     "'nics[0].address'"),
    ("record-older-bimetal", _record_payload(version=1), "rank 0 runs an older bimetal"),
]


@pytest.mark.parametrize(("text", "fragment"), [c[1:] for c in RECORD_CASES], ids=[c[0] for c in RECORD_CASES])
def test_bad_topology_record(text, fragment: str) -> None:
    with pytest.raises(UserError) as info:
        RankRecord.from_json(text, expected_rank=0)
    assert fragment in str(info.value) and "rank 0" in str(info.value)


def test_catalogue_has_at_least_thirty_cases() -> None:
    assert len(CLI_CASES) + len(RECORD_CASES) >= 30
