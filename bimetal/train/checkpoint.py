"""Atomic checkpoints with ``torch.distributed.checkpoint``.

Layout: ``<folder>/step-000010/`` holds one DCP checkpoint per pipeline stage (``stage0/``, ``stage1/``, written
by the stage's first dp replica; the other replicas hold the same tensors) plus ``meta.json`` (step, model
family/flavour, layout) and, written last by rank 0 after a barrier, ``COMPLETE``. Each stage is saved and
loaded with ``no_dist=True``: DCP's collective planning exchanges pickled objects between ranks, and no
bimetal network path unpickles anything; the only traffic here is tensor barriers. A folder without
``COMPLETE`` is a half-written save and is never loaded. Everything is written into ``.tmp-step-N`` first and
renamed once all ranks are done, so a crash leaves at most a temp folder that the next save replaces.
Per-rank state that is not a tensor (data position, RNG) goes into ``extra-rank<R>.json``: JSON, not pickle.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from bimetal.errors import UserError

MARKER = "COMPLETE"


def training_state(model: nn.Module, opt: torch.optim.Optimizer, stage: int) -> dict[str, Any]:
    """Model and optimizer state of one stage, keyed ``stage<N>`` so stages never collide in the DCP store.

    ``get_state_dict`` keys optimizer state by parameter name and creates it if no step has run yet, which a
    load needs: DCP fills only the tensors the target already has, so a fresh optimizer would load nothing.
    """
    model_sd, optim_sd = get_state_dict(model, opt)
    return {f"stage{stage}": {"model": model_sd, "optim": optim_sd}}


def apply_training_state(model: nn.Module, opt: torch.optim.Optimizer, stage: int, state: dict[str, Any]) -> None:
    """Put a loaded ``training_state`` back into ``model`` and ``opt``."""
    part = state[f"stage{stage}"]
    set_state_dict(model, opt, model_state_dict=part["model"], optim_state_dict=part["optim"])


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def rng_state() -> dict[str, Any]:
    """The CPU torch RNG as JSON-ready data."""
    return {"torch_cpu": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))


def save(folder: str | Path, step: int, state: dict[str, Any], extra: dict[str, Any], meta: dict[str, Any],
         rank: int = 0, group: dist.ProcessGroup | None = None, shard: str = "stage0", writer: bool = True) -> Path:
    """Save ``state`` (tensors: model, optimizer) with DCP and ``extra`` (JSON) for this rank; returns the folder.

    Every rank calls this; ``group`` is the group spanning all ranks (None = world). ``shard`` names this
    rank's part (its stage) and ``writer`` says whether this rank writes it (one replica per stage does).
    """
    root = Path(folder)
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    if writer:
        dcp.save(state, checkpoint_id=str(tmp / shard), no_dist=True)
    (tmp / f"extra-rank{rank}.json").write_text(json.dumps(extra))
    _barrier(group)
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (final / MARKER).write_text(str(step))
    _barrier(group)
    return final


def latest(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under ``folder``, or None."""
    root = Path(folder)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / MARKER).is_file())
    return done[-1] if done else None


def check_meta(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Raise ``UserError`` if the checkpoint at ``path`` was written for another model or layout."""
    saved = json.loads((path / "meta.json").read_text())
    for key in ("family", "flavour", "layers_per_stage", "dp", "dp_shard"):
        if saved.get(key, 1 if key == "dp_shard" else None) != meta.get(key, 1 if key == "dp_shard" else None):
            raise UserError(f"checkpoint {path} is for {key}={saved.get(key)!r} but this run has {key}="
                            f"{meta.get(key)!r}; point checkpoint.folder elsewhere or match the config.")
    return saved


def load(path: Path, state: dict[str, Any], rank: int, shard: str = "stage0") -> dict[str, Any]:
    """Load this rank's part (``shard``) into ``state`` in place and return this rank's JSON extra."""
    if not (path / shard).is_dir():
        raise UserError(f"checkpoint {path} has no {shard}/ part; it was written for another layout or is damaged.")
    dcp.load(state, checkpoint_id=str(path / shard), no_dist=True)
    return json.loads((path / f"extra-rank{rank}.json").read_text())
