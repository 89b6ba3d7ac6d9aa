"""Atomic checkpoints with ``torch.distributed.checkpoint``.

Layout: ``<folder>/step-000010/`` holds one DCP checkpoint per pipeline stage (``stage0/``, ``stage1/``, written
by the stage's first dp replica; the other replicas hold the same tensors) plus ``meta.json`` (step, model
family/flavour, layout) and, written last by rank 0 after a barrier, ``COMPLETE``. Each stage is saved and
loaded with ``no_dist=True``: DCP's collective planning exchanges pickled objects between ranks, and no
bimetal network path unpickles anything; the only traffic here is tensor barriers. A folder without
``COMPLETE`` is a half-written save and is never loaded; ``COMPLETE`` lists every file with its size, so a
checkpoint damaged afterwards (a file cut short or lost) is recognised before loading and skipped for the one
before it. ``prune`` keeps the newest ``checkpoint.keep_last``. Everything is written into ``.tmp-step-N`` first and
renamed once all ranks are done, so a crash leaves at most a temp folder that the next save replaces.
Per-rank state that is not a tensor (data position, RNG) goes into ``extra-rank<R>.json``: JSON, not pickle.
A tensor-parallel stage is saved as whole tensors (its tp ranks gather each ``DTensor``, tp rank 0 writes)
and each rank loads only its own slices; ``meta.json`` records tp, and a resume onto another tp is refused
because the per-rank extras belong to the old layout's ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from bimetal.errors import UserError

MARKER = "COMPLETE"


def training_state(model: nn.Module, opt: torch.optim.Optimizer, stage: int) -> dict[str, Any]:
    """Model and optimizer state of one stage, keyed ``stage<N>`` so stages never collide in the DCP store.

    ``get_state_dict`` keys optimizer state by parameter name and creates it if no step has run yet, which a
    load needs: DCP fills only the tensors the target already has, so a fresh optimizer would load nothing.
    A tensor-parallel stage gives ``DTensor``s (each rank's slice); ``save`` gathers them, ``load`` reads
    only each rank's slice back.
    """
    model_sd, optim_sd = get_state_dict(model, opt)
    return {f"stage{stage}": {"model": model_sd, "optim": optim_sd}}


def apply_training_state(model: nn.Module, opt: torch.optim.Optimizer, stage: int, state: dict[str, Any]) -> None:
    """Put a loaded ``training_state`` back into ``model`` and ``opt``."""
    part = state[f"stage{stage}"]
    set_state_dict(model, opt, model_state_dict=part["model"], optim_state_dict=part["optim"])


def _whole(state: Any, keep: bool) -> Any:
    """``state`` with every ``DTensor`` gathered into a whole CPU tensor, one at a time (a collective over its
    mesh: every rank holding slices calls this, in the same order); ``keep=False`` takes part and drops."""
    if isinstance(state, dict):
        return {k: _whole(v, keep) for k, v in state.items()}
    if isinstance(state, list):
        return [_whole(v, keep) for v in state]
    if isinstance(state, DTensor):
        whole = state.full_tensor()
        return whole.cpu() if keep else None
    return state


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
    ``DTensor`` slices (tensor parallelism) are gathered first, so a stage's part holds whole tensors and
    does not depend on tp; ``load`` into ``DTensor``s reads just each rank's slice of them.
    """
    state = _whole(state, keep=writer)
    root = Path(folder)
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    if writer:
        with _no_single_process_warning():
            dcp.save(state, checkpoint_id=str(tmp / shard), no_dist=True)
    (tmp / f"extra-rank{rank}.json").write_text(json.dumps(extra))
    _barrier(group)
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        files = _manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (final / MARKER).write_text(json.dumps({"step": step, "files": files}))
    _barrier(group)
    return final


def _manifest(folder: Path) -> dict[str, int]:
    """Every file of a checkpoint folder (relative path -> size in bytes), as written."""
    return {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}


def damage(path: Path) -> str | None:
    """Why the complete checkpoint ``path`` cannot be loaded (a file missing or cut short), or None if intact.

    The marker lists every file and its size at save time; a checkpoint from before the list existed (its
    marker holds only the step) is taken as intact.
    """
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return f"its {MARKER} marker cannot be read"
    files = marker.get("files", {}) if isinstance(marker, dict) else {}
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


def _steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-N`` folder under ``root``, oldest first (by number: 7 digits sort right)."""
    found = [(int(p.name[5:]), p) for p in root.glob("step-*") if p.name[5:].isdigit() and p.is_dir()]
    return sorted(found) if root.is_dir() else []


def _complete(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` that carry the marker, oldest first."""
    return [p for _, p in _steps(root) if (p / MARKER).is_file()]


def latest(folder: str | Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete and intact checkpoint under ``folder``, or None.

    A newer one that is damaged is skipped in favour of the one before it; ``warn`` gets one sentence for it.
    """
    root = Path(folder)
    skipped: list[tuple[Path, str]] = []
    found = None
    for path in reversed(_complete(root)):
        why = damage(path)
        if why is None:
            found = path
            break
        skipped.append((path, why))
    if warn is not None:
        instead = (f"resuming from {found.name} instead" if found
                   else "no intact checkpoint is left, so the run starts from step 0")
        for path, why in skipped:
            warn(f"checkpoint {path} is damaged ({why}); {instead}.")
    return found


def prune(folder: str | Path, keep_last: int) -> list[Path]:
    """Delete checkpoints older than the newest ``keep_last`` intact ones (0 keeps all); returns what went.

    Half-written and damaged folders older than the oldest kept checkpoint go too; newer ones stay.
    """
    if keep_last <= 0:
        return []
    root = Path(folder)
    intact = [p for p in reversed(_complete(root)) if damage(p) is None][:keep_last]
    if len(intact) < keep_last:
        return []
    folders = [p for _, p in _steps(root)]
    gone = folders[:folders.index(intact[-1])]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


# Keys added after checkpoints without them were written: their value in those checkpoints.
_META_DEFAULTS = {"tp": 1, "dp_shard": 1}


def check_meta(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Raise ``UserError`` if the checkpoint at ``path`` was written for another model or layout."""
    saved = json.loads((path / "meta.json").read_text())
    for key in ("family", "flavour", "layers_per_stage", "dp", "dp_shard", "tp"):
        was, now = saved.get(key, _META_DEFAULTS.get(key)), meta.get(key, _META_DEFAULTS.get(key))
        if was != now:
            raise UserError(f"checkpoint {path} is for {key}={was!r} but this run has {key}={now!r}; point "
                            "checkpoint.folder elsewhere or match the config.")
    return saved


def load(path: Path, state: dict[str, Any], rank: int, shard: str = "stage0") -> dict[str, Any]:
    """Load this rank's part (``shard``) into ``state`` in place and return this rank's JSON extra."""
    if not (path / shard).is_dir():
        raise UserError(f"checkpoint {path} has no {shard}/ part; it was written for another layout or is damaged.")
    quiet = _QuietLoader()  # DCP logs each failed metadata read with a traceback on the root logger
    logging.getLogger().addFilter(quiet)
    try:
        with _no_single_process_warning():
            dcp.load(state, checkpoint_id=str(path / shard), no_dist=True)
        return json.loads((path / f"extra-rank{rank}.json").read_text())
    except (Exception, CheckpointException) as exc:  # damage that keeps file sizes shows only here
        # DCP wraps the cause in a report holding the rank's traceback: its last line says what went wrong.
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        why = lines[-1] if len(lines[-1]) <= 160 else lines[-1][:157] + "..."
        raise UserError(f"checkpoint {path} cannot be read ({why}); move it away and resume again to "
                        "continue from the one before it.") from None
    finally:
        logging.getLogger().removeFilter(quiet)


@contextlib.contextmanager
def _no_single_process_warning() -> Iterator[None]:
    """``no_dist=True`` is deliberate here; DCP's warning that it assumes one process would only be noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class _QuietLoader(logging.Filter):
    """Drops the root-logger records of DCP's loader while ``load`` runs; its failure is reported as a sentence."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.endswith("state_dict_loader.py")
