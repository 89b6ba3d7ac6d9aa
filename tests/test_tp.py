"""Tensor parallelism: a tp=2 model equals the single-device model, and what tp cannot split is refused.

The training run itself (pp=2 x tp=2 across simulated vendors, loss parity with one process, resume, HF
export, cross-vendor bytes equal to tp=1) is a row of ``test_train_parity.py``. Here: ``tp_rank.py`` on two
ranks of one simulated vendor checks, for the debug LLaMA-3 (grouped-query attention) and the debug Qwen2
(tied embeddings, qkv bias), the loss, every gradient, the global gradient norm and the number of
collectives against the unsplit model, and that checkpoint state is whole tensors that load back into the
split model bit for bit. Then the refusals: a tp that does not divide the heads (before any rank starts)
and a resume onto another tp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_inprocess import cli_main
from launcher import launch

from bimetal.errors import UserError
from bimetal.train import checkpoint

pytestmark = pytest.mark.timeout(200)
HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "configs" / "demo.toml"


def test_tp2_matches_the_single_device_model(tmp_path: Path) -> None:
    proc = launch("nvidia:2", str(HERE / "tp_rank.py"), str(tmp_path), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(tmp_path.glob("rank*.json"))
    assert len(files) == 2
    for f in files:
        results = json.loads(f.read_text())
        assert {r["case"].split(":")[0] for r in results} == {"llama3", "qwen2"}
        assert len(results) > 200, f"{f.name}: only {len(results)} checks ran"
        bad = [f"{r['case']}: {r['detail']}" for r in results if not r["ok"]]
        assert not bad, f"{f.name}: " + "\n".join(bad[:10])


def test_tp_that_does_not_divide_the_heads_is_refused_before_launch(tmp_path: Path, capsys, monkeypatch) -> None:
    # 3 divides neither the debug model's 4 heads nor the world; the heads are named, and nothing launches. The
    # refusal comes before any rank: by bimetal.cli.main in this process (cli_inprocess); a layout refused through
    # the executable is test_first_contact.py's no-simulate-outside-torchrun.
    code, _, err = cli_main(["train", "--config", str(DEMO), "--parallel.dp=1", "--parallel.tp=3",
                             f"--metrics.run_dir={tmp_path / 'run'}", "--simulate", "nvidia:3,amd:3"], capsys,
                            monkeypatch)
    assert code == 2, err[-2000:]
    assert "parallel.tp=3" in err and "n_heads=4" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_resume_onto_another_tp_is_refused(tmp_path: Path) -> None:
    meta = {"family": "llama3", "flavour": "debug", "layers_per_stage": [3, 1], "dp": 1, "tp": 2}
    path = checkpoint.save(tmp_path / "a", 1, {"x": {"w": torch.zeros(2)}}, {}, meta)
    checkpoint.check_meta(path, meta)
    with pytest.raises(UserError, match=r"tp=2 but this run has tp=1"):
        checkpoint.check_meta(path, {**meta, "tp": 1})
    # A checkpoint written before the tp key existed is a tp=1 checkpoint.
    path = checkpoint.save(tmp_path / "b", 1, {"x": {"w": torch.zeros(2)}}, {},
                           {k: v for k, v in meta.items() if k != "tp"})
    checkpoint.check_meta(path, {**meta, "tp": 1})
    with pytest.raises(UserError, match=r"tp=1 but this run has tp=2"):
        checkpoint.check_meta(path, meta)


def test_planner_writes_tp_plans_the_trainer_accepts(tmp_path: Path) -> None:
    # Every plan the planner ranks for LLaMA-3-8B at seq 8192 on H100 + MI300X uses tp >= 2 (issue 16); the
    # config it writes for one carries parallel.tp, and the trainer's pre-launch checks accept it.
    import tomli_w

    from bimetal.config import load_config
    from bimetal.plan.cli import plan_to_train_config
    from bimetal.plan.search import search
    from bimetal.plan.spec import load_spec
    from bimetal.train.prepare import _check_tp_divides_model

    ok, _ = search(load_spec(str(HERE.parent / "configs" / "clusters" / "h100_mi300x.toml")), "llama3-8b", 8192, 256)
    plan = next(p for p in ok if p.tp > 1)
    out = tmp_path / "plan.toml"
    out.write_text(tomli_w.dumps(plan_to_train_config(plan)))
    cfg = load_config(str(out), [])
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp) == (plan.pp, plan.dp, plan.tp)
    _check_tp_divides_model(cfg)
