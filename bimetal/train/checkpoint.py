"""Atomic checkpoints with ``torch.distributed.checkpoint``.

Layout: ``<folder>/step-000010/`` holds one DCP checkpoint per pipeline stage (``stage0/``, ``stage1/``, written
by the stage's first dp replica; the other replicas hold the same tensors) plus ``meta.json`` (step, model
family/flavour, layout) and, written last by rank 0 after a barrier, ``COMPLETE``. Each stage is saved and
loaded with ``no_dist=True``: DCP's collective planning exchanges pickled objects between ranks, and no
bimetal network path unpickles anything; the only traffic here is tensor barriers. A folder without
``COMPLETE`` is a half-written save and is never loaded; ``COMPLETE`` lists every file with its size, so a
checkpoint damaged afterwards (a file cut short or lost) is recognised before loading and skipped for the one
before it; the marker also holds each file's CRC-32 (a writer sums its own part), so a file changed in place is
found too when the ranks pick the checkpoint to resume from (``agree_latest``, the same reading of the folder as
the check before ranks start, ``bimetal.train.ckpt_files.scan``): whichever file is damaged, the run resumes from
the checkpoint before it, and where none is usable it stops, changing nothing. The folder's files without torch:
``bimetal.train.ckpt_files``. ``prune`` keeps the newest ``checkpoint.keep_last`` intact ones and never deletes
a damaged one. Everything is written into ``.tmp-step-N`` first and renamed once all ranks are done, so a crash
leaves at most a temp folder that the next save replaces; a step folder already there (one the resume passed
over) is set aside as ``step-N.damaged``, never replaced.
Per-rank state that is not a tensor (data position, RNG) goes into ``extra-rank<R>.json``: JSON, not pickle.
A tensor-parallel stage is saved as whole tensors (its tp ranks gather each ``DTensor``, tp rank 0 writes)
and each rank loads only its own slices.

One checkpoint, any layout: every tensor is keyed by its name in the whole model (``model.layers.7.attention.
wq.weight``, ``optim.state.layers.7.attention.wq.weight.exp_avg``: the layer index is the whole model's, never
the stage's), and ``extra-rank<R>.json`` holds the run's global position (the step, the scheduler, the data
windows taken by all replicas together, the RNG), equal on every rank. ``meta.json`` says so (``"keys":
"global"``). A resume on the layout that wrote it reads each rank's own part and extra as before; a resume on
another layout (pp split, dp, dp_shard, tp, per-stage shapes, vendor mix) reads, for each tensor this rank holds,
the stage part of the old split that holds its name (``load_moved``): DCP reshards the whole tensors into this
rank's ``DTensor`` slices (tp, FSDP), still with ``no_dist=True`` and one folder per stage, so nothing is
planned over the network. Such a rank takes rank 0's extra: the step, data position and learning rate are the
run's; the RNG state of rank 0 is every rank's (each rank seeds alike and training draws nothing from it: the
data order has its own generator and the models have no dropout). The optimizer's hyper-parameters come from the
config (kept by the trajectory check), its learning rate from the scheduler. An FSDP stage written as shard
parts (``stage<S>-shard<I>``, see ``shards``) is joined into whole tensors by each reading rank (``assemble``)
and cut into its slices.
Checkpoints written before the global keys (their tensors under ``stage<N>.``) load on their own layout
(``legacy``), and are refused on another one.
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

from bimetal import faults
from bimetal.errors import UserError
from bimetal.train.ckpt_files import (
    MARKER,
    Scan,
    check_meta,
    crc32,
    damage,
    latest,
    manifest,
    prune,
    scan,
    set_aside,
)

__all__ = ["MARKER", "Scan", "agree_latest", "apply_training_state", "check_meta", "damage", "latest", "load",
           "load_moved", "prune", "rng_state", "save", "set_rng_state", "training_state"]
_log = logging.getLogger(__name__)
_WHY_BYTES = 512  # the reason a rank found a checkpoint damaged, sent to the others as UTF-8 (cut to this)


def training_state(model: nn.Module, opt: torch.optim.Optimizer, stage: int, legacy: bool = False) -> dict[str, Any]:
    """Model and optimizer state of one stage under the whole model's names (``legacy``: under ``stage<N>``, as
    checkpoints before the global keys held it).

    ``get_state_dict`` keys optimizer state by parameter name and creates it if no step has run yet, which a
    load needs: DCP fills only the tensors the target already has, so a fresh optimizer would load nothing.
    A tensor-parallel stage gives ``DTensor``s (each rank's slice); ``save`` gathers them, ``load`` reads
    only each rank's slice back.
    """
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    return {f"stage{stage}": state} if legacy else state


def apply_training_state(model: nn.Module, opt: torch.optim.Optimizer, stage: int, state: dict[str, Any],
                         legacy: bool = False) -> None:
    """Put a loaded ``training_state`` back into ``model`` and ``opt``."""
    part = state[f"stage{stage}"] if legacy else state
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
        # Each writer sums its own part while it is still in the page cache; rank 0 sums only the small rest.
        sums = {str(f.relative_to(tmp)): crc32(f) for f in sorted((tmp / shard).rglob("*")) if f.is_file()}
        (tmp / f".sums-rank{rank}.json").write_text(json.dumps(sums))
    (tmp / f"extra-rank{rank}.json").write_text(json.dumps(extra))
    faults.in_checkpoint(rank, step)  # fault injection for the reliability tests; no-op unless configured
    _barrier(group)
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        sums = {}
        for f in tmp.glob(".sums-rank*.json"):
            sums.update(json.loads(f.read_text()))
            f.unlink()
        body = manifest(tmp, sums)
        aside = set_aside(final)  # passed over by the resume: kept for the user, never replaced
        if aside is not None:
            _log.warning("checkpoint %s was passed over when this run resumed; kept as %s, step %d saved anew.",
                         final, aside.name, step)
        tmp.rename(final)
        (final / MARKER).write_text(json.dumps({"step": step, **body}))
    _barrier(group)
    return final


def agree_latest(folder: str | Path, rank: int, reads: Callable[[Path, str], bool],
                 group: dist.ProcessGroup | None = None) -> Scan:
    """The reading of ``folder`` every rank shares (``ckpt_files.scan``); every rank calls this.

    Each rank checks the whole checkpoint's marker, sizes and JSON files, and reads the files it will load
    (``reads`` selects them by checkpoint and name) against their checksums; the ranks then agree (a MIN over
    the world) on each verdict: a checkpoint any rank found damaged is passed over by all, with the reason of
    the lowest rank that found it (sent to every rank), so every rank holds the same ``Scan``.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1

    def agree(path: Path, why: str | None) -> str | None:
        if world == 1:
            return why
        first = torch.tensor([rank if why else world], dtype=torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        if int(first) == world:
            return None
        text = torch.zeros(_WHY_BYTES, dtype=torch.uint8)
        if int(first) == rank and why:
            raw = why.encode()[:_WHY_BYTES]
            text[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        src = int(first) if group is None else dist.get_global_rank(group, int(first))
        dist.broadcast(text, src=src, group=group)
        return bytes(text.tolist()).rstrip(b"\0").decode(errors="replace")

    return scan(folder, reads, agree)


def load(path: Path, state: dict[str, Any], rank: int, shard: str = "stage0") -> dict[str, Any]:
    """Load this rank's part (``shard``) into ``state`` in place and return this rank's JSON extra."""
    if not (path / shard).is_dir():
        raise UserError(f"checkpoint {path} has no {shard}/ part; it was written for another layout or is damaged.")
    _read(path, path / shard, state)
    return _extra(path, rank)


def load_moved(path: Path, state: dict[str, Any], split: list[int], stage_of: Callable[[str, list[int]], int]
               ) -> dict[str, Any]:
    """Load ``state`` (``{"model": {name: tensor}, "optim": {"state": {name: {key: tensor}}}}``, whole-model
    names) from a checkpoint written on another layout, whose stage split was ``split``: each name from the part
    of the stage (``stage_of``) that held it. Returns rank 0's extra, the run's global position."""
    by_stage: dict[int, dict[str, Any]] = {}
    for name, t in state["model"].items():
        by_stage.setdefault(stage_of(name, split), {"model": {}, "optim": {"state": {}}})["model"][name] = t
    for name, s in state["optim"]["state"].items():
        by_stage.setdefault(stage_of(name, split), {"model": {}, "optim": {"state": {}}})["optim"]["state"][name] = s
    for stage, part in sorted(by_stage.items()):
        folder = path / f"stage{stage}"
        if folder.is_dir():
            _read(path, folder, part)  # whole tensors: DCP reads each DTensor's slice itself
        elif any(path.glob(f"stage{stage}-shard*")):
            _read_shards(path, stage, part)
        else:
            raise UserError(f"checkpoint {path} has no part for its stage {stage}; it is damaged.")
    return _extra(path, 0)


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``state`` as one level, its keys joined with dots as DCP flattens them."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(_flat(value, name) if isinstance(value, dict) else {name: value})
    return out


def _read_shards(path: Path, stage: int, part: dict[str, Any]) -> None:
    """Fill ``part`` from the FSDP shard parts of ``stage`` (``stage<S>-shard<I>/``, local shards and their
    layout in the writers' extras, ``shards``): each part read whole by this process, the shards joined into
    whole tensors, then this rank's slice of each taken (``distribute_tensor`` without a source rank cuts it
    locally: no traffic)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import distribute_tensor

    from bimetal.train.shards import assemble

    layouts = {}
    for f in path.glob("extra-rank*.json"):
        extra = json.loads(f.read_text())
        if "shards" in extra:
            layouts[extra["shards"]["part"]] = extra["shards"]["tensors"]
    want = _flat(part)
    pieces, lays = [], []
    for folder in sorted(path.glob(f"stage{stage}-shard*")):
        stored = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        buf = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()
               if k in want and isinstance(m, TensorStorageMetadata)}
        _read(path, folder, buf)
        pieces.append(buf)
        lays.append(layouts.get(folder.name, {}))
    whole = assemble(pieces, lays)
    for key, target in want.items():
        if key not in whole:
            raise UserError(f"checkpoint {path} holds no {key} in its stage {stage}; it was written for another "
                            "model or is damaged.")
        with torch.no_grad():
            if isinstance(target, DTensor):
                mine = distribute_tensor(whole[key], target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(mine.to_local())
            else:
                target.copy_(whole[key])


def _extra(path: Path, rank: int) -> dict[str, Any]:
    extra = json.loads((path / f"extra-rank{rank}.json").read_text())
    assert isinstance(extra, dict)  # checked as a JSON object by damage()
    return extra


def _read(path: Path, folder: Path, state: dict[str, Any]) -> None:
    """DCP-load ``folder`` (one part of the checkpoint ``path``) into ``state``, in place, by this process alone."""
    quiet = _QuietLoader()  # DCP logs each failed metadata read with a traceback on the root logger
    logging.getLogger().addFilter(quiet)
    try:
        with _no_single_process_warning():
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
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
