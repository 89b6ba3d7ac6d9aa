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
    ("no-lab-sub-command", lambda t: ["lab"], "no sub-command given; usage: bimetal lab {up,down,run,status}"),
    ("plan-calibrate-without-lab", lambda t: ["plan", "calibrate"], "--lab"),
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
    ("config-unknown-flavour", lambda t: ["train", "--config", str(DEMO), "--model.flavour=llama3-9000b"],
     "model llama3/llama3-9000b is unknown"),
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


# ---- nothing lost, nothing silent (issue 30): outputs, exports, the dry-run, resumes, options, the launcher ----
# The same classes run through the executable, one row each, in test_nothing_lost.py.

def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _file(t: Path) -> Path:
    (t / "a-file").write_text("x")
    return t / "a-file"


def _checkpoint(t: Path, **changes: object) -> str:
    """A run folder holding one complete checkpoint's marker and meta.json for the defaults (with ``changes``)."""
    from bimetal.config import load_config
    from bimetal.train.ckpt_files import MARKER, run_meta

    cfg = load_config(None, {k: str(v) for k, v in changes.items()})
    step = t / "run" / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps(run_meta(cfg, [4])))
    (step / MARKER).write_text(json.dumps({"step": 2, "files": {"meta.json": (step / "meta.json").stat().st_size}}))
    return str(t / "run")


def _foreign_weights(t: Path) -> str:
    (t / "hf").mkdir()
    (t / "hf" / "model.gguf").write_bytes(b"x")
    return str(t / "hf")


# (case id, environment, argv builder taking tmp_path, fragment of the one sentence)
NOTHING_LOST: list[tuple[str, dict[str, str], object, str]] = [
    ("run-dir-under-a-file", {}, lambda t: ["train", f"--metrics.run_dir={_file(t)}/run"], "metrics.run_dir="),
    ("run-dir-empty", {}, lambda t: ["train", "--metrics.run_dir="], "metrics.run_dir is empty"),
    ("checkpoint-folder-is-a-file", {}, lambda t: ["train", f"--checkpoint.folder={_file(t)}"], "is a file"),
    ("checkpoint-folder-under-a-file-simulated", {}, lambda t: ["train", "--simulate", "nvidia:1,amd:1",
                                                                f"--checkpoint.folder={_file(t)}/ck"],
     "checkpoint.folder="),
    ("export-folder-is-a-file", {}, lambda t: ["train", f"--checkpoint.export_hf={_file(t)}"], "checkpoint.export_hf="),
    ("export-beside-gguf", {}, lambda t: ["train", f"--checkpoint.export_hf={_foreign_weights(t)}"], "model.gguf"),
    ("export-shard-negative", {}, lambda t: ["train", "--checkpoint.export_shard_bytes=-1"],
     "checkpoint.export_shard_bytes=-1"),
    ("config-file-names-checkpoint-folder", {}, lambda t: ["train", "--config", _write(
        t, "c.toml", f'[checkpoint]\nfolder = "{_file(t)}/ck"\n')], "c.toml: checkpoint.folder="),
    ("config-file-names-split", {}, lambda t: ["train", "--config", _demo_with(t, "[3, 1]", "[3, 3]"), "--simulate",
                                               "nvidia:2,amd:2"], "cfg.toml: parallel.layers_per_stage=[3, 3]"),
    ("config-file-names-layout", {}, lambda t: ["train", "--config", str(DEMO), "--simulate", "nvidia:1,amd:1"],
     "demo.toml: the layout parallel.pp=2"),
    ("config-is-a-folder", {}, lambda t: ["train", "--config", str(t)], "is a folder"),
    ("split-vs-chosen-layout", {}, lambda t: ["train", "--simulate", "nvidia:1,amd:1",
                                              "--parallel.layers_per_stage=[2,1,1]"], "layout chosen from the 2"),
    ("split-vs-chosen-layout-dry-run", {}, lambda t: ["train", "--simulate", "nvidia:1,amd:1", "--dry-run",
                                                      "--parallel.layers_per_stage=[2,1,1]"],
     "layout chosen from the 2"),
    ("cluster-spec-missing-run", {}, lambda t: ["train", "--parallel.cluster=none.toml"], "cluster spec none.toml"),
    ("resume-changed-seq-len", {}, lambda t: ["train", "--resume", f"--metrics.run_dir={_checkpoint(t)}",
                                              "--data.seq_len=64"],
     "data.seq_len=128 but this run has data.seq_len=64"),
    ("resume-changed-data-seed-dry-run", {}, lambda t: ["train", "--resume", "--dry-run", "--training.seed=7",
                                                        f"--metrics.run_dir={_checkpoint(t)}"], "training.seed=1234"),
    ("resume-another-model", {}, lambda t: ["train", "--resume", "--resume-changed", "--model.family=qwen2",
                                            f"--metrics.run_dir={_checkpoint(t)}"], "family='llama3'"),
    ("resume-changed-without-resume", {}, lambda t: ["train", "--resume-changed"], "checkpoint.resume is off"),
    ("max-restarts-without-simulate", {}, lambda t: ["train", "--max-restarts=1"], "--max-restarts needs --simulate"),
    ("simulate-device-without-simulate", {"BIMETAL_SIMULATE_DEVICE": "cuda"}, lambda t: ["train"],
     "only applies to simulated ranks"),
    ("dd-device-gpu-absent", {"BIMETAL_DD_DEVICE": "cuda:0"}, lambda t: ["train", "--simulate", "nvidia:1,amd:1"],
     "BIMETAL_DD_DEVICE=cuda:0 asks for GPU 0"),
    ("dd-gid-index-not-an-index", {"BIMETAL_DD_GID_INDEX": "fe80::1"}, lambda t: ["train", "--simulate",
                                                                                  "nvidia:1,amd:1"],
     "BIMETAL_DD_GID_INDEX='fe80::1' is not valid; set it to an integer from 0 to 255"),
    ("plan-write-is-a-folder", {}, lambda t: ["plan", str(SPEC), "--write", str(t)], "is a folder"),
    ("plan-write-titan-under-a-file", {}, lambda t: ["plan", str(SPEC), "--write-titan", f"{_file(t)}/t.toml"],
     "--write-titan="),
    ("plan-same-file-twice", {}, lambda t: ["plan", str(SPEC), "--write", f"{t}/p", "--write-titan", f"{t}/p"],
     "name the same file"),
    ("plan-cross-vendor-needs-write", {}, lambda t: ["plan", str(SPEC), "--allow-cross-vendor-dp"], "add --write"),
    ("plan-explain-with-json", {}, lambda t: ["plan", str(SPEC), "--explain", "--json"], "--explain"),
    ("plan-write-with-one-layout", {}, lambda t: ["plan", str(SPEC), "--pp", "2", "--write", f"{t}/p.toml"],
     "--write writes the best plan of a search"),
    ("plan-json-with-one-layout", {}, lambda t: ["plan", str(SPEC), "--pp", "2", "--json"], "--json shapes"),
    ("plan-fit-out-under-a-file", {}, lambda t: ["plan", "fit", str(SPEC), "--bench-comm", "x.json", "--out",
                                                 f"{_file(t)}/s.toml"], "--out="),
    ("profile-out-under-a-file", {}, lambda t: ["profile", "--out", f"{_file(t)}/p.json"], "--out="),
    ("bench-comm-out-under-a-file", {}, lambda t: ["bench", "comm", "--simulate", "nvidia:1,amd:1", "--out",
                                                   f"{_file(t)}/b"], "--out="),
    ("launch-script-missing", {}, lambda t: ["launch", "--simulate", "nvidia:1,amd:1", "--", f"{t}/none.py"],
     "does not exist"),
    ("launch-module-missing", {}, lambda t: ["launch", "--simulate", "nvidia:1,amd:1", "--", "-m", "bimetal.nothing"],
     "module 'bimetal.nothing' cannot be found"),
    ("launch-node-rank-outside", {}, lambda t: ["launch", "--nnodes", "2", "--node-rank", "2", "--master-addr",
                                                "127.0.0.1", "--", "-c", "pass"], "--node-rank 2"),
    ("launch-nodes-without-master", {}, lambda t: ["launch", "--nnodes", "2", "--", "-c", "pass"],
     "needs --master-addr"),
    ("launch-port-not-a-port", {}, lambda t: ["launch", "--master-port", "70000", "--", "-c", "pass"],
     "is not a TCP port"),
    ("topo-timeout-zero", {}, lambda t: ["topo", "--simulate", "nvidia:1,amd:1", "--timeout", "0"], "--timeout 0.0"),
    ("topo-layout-vs-world", {}, lambda t: ["topo", "--simulate", "nvidia:1,amd:1", "--pp", "3"],
     "does not match the world size 2"),
    ("titan-dump-under-a-file", {}, lambda t: ["titan", "--module", "llama3", "--simulate", "nvidia:1,amd:1",
                                               f"--dump_folder={_file(t)}/out"], "--dump_folder="),
    ("titan-assets-without-simulate", {}, lambda t: ["titan", "--module", "llama3", "--assets", str(t)],
     "--assets is where --simulate writes"),
    ("titan-cpu-with-simulate", {}, lambda t: ["titan", "--module", "llama3", "--cpu", "--simulate", "nvidia:1"],
     "drop --cpu"),
    ("titan-gpu-rank-without-gpu", {}, lambda t: ["titan", "--module", "llama3", f"--dump_folder={t}/out"],
     "sees no GPU"),
    ("transport-unknown-unused", {}, lambda t: ["train", "--parallel.dp_transport=rdma"],
     "parallel.dp_transport='rdma' is unknown"),
    ("option-without-value", {}, lambda t: ["train", "--simulate"], "--simulate: expected one argument"),
    ("option-not-a-number", {}, lambda t: ["launch", "--nnodes", "two", "--", "-c", "pass"], "invalid int value"),
    ("argument-missing", {}, lambda t: ["plan"], "the following arguments are required: spec"),
]


@pytest.mark.parametrize(("env", "build", "fragment"), [c[1:] for c in NOTHING_LOST], ids=[c[0] for c in NOTHING_LOST])
def test_nothing_lost_bad_input(env: dict[str, str], build, fragment: str, tmp_path: Path, capsys,
                                monkeypatch) -> None:
    if ("no GPU" in fragment or "asks for GPU" in fragment) and _gpu():
        pytest.skip("the case is a GPU asked for and absent; this machine has one")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BIMETAL_SIMULATE", "BIMETAL_VENDOR"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    argv = build(tmp_path)
    if argv[0] == "train" and not any(a.startswith("--metrics.run_dir") for a in argv):
        argv.append(f"--metrics.run_dir={tmp_path / 'run'}")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (code, captured.out[-2000:], captured.err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("bimetal") and fragment in lines[0], captured.err
    assert "Traceback" not in captured.err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_tensorboard_asked_for_and_absent(tmp_path: Path, capsys, monkeypatch) -> None:
    """A machine without the tensorboard package (hidden from ``importlib.util.find_spec`` here): the setting is
    refused in one sentence instead of being ignored."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "tensorboard" else real(name, *a, **k))
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--metrics.tensorboard=true", f"--metrics.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.tensorboard=true needs the tensorboard package" in err, err
    assert not (tmp_path / "run").exists()
