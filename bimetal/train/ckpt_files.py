"""What a checkpoint folder holds, read without torch: the marker and its manifest, damage, the newest usable
checkpoint, pruning, and what a resume must keep.

``COMPLETE`` (written last) lists every file of the checkpoint with its size and, for checkpoints written since
it was added, its CRC-32. ``damage`` says why a checkpoint cannot be used - its marker unreadable, a file
missing or cut short, a JSON file that is not what was written, a file whose contents changed - so every kind
of damage, whichever file holds it, leads to the same place: the checkpoint before it (``latest``; in a job,
``bimetal.train.trainer`` lets every rank check the files it reads and takes the newest all ranks can use).

``run_meta`` is what ``meta.json`` records of the config: the layout (a resume onto another one is refused: the
per-rank state belongs to the old ranks) and the settings the loss trajectory depends on (``TRAJECTORY``), which
a resume keeps unless told otherwise (``checkpoint.resume_changed``), so that a resumed run continues the run
that wrote the checkpoint. Used by the trainer and by the checks before any rank starts.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bimetal.config import TrainConfig
from bimetal.errors import UserError

MARKER = "COMPLETE"
LAYOUT = ("family", "flavour", "layers_per_stage", "dp", "dp_shard", "tp", "stage_shapes")
"""``meta.json`` keys of the layout: a checkpoint of another one is refused, with or without resume_changed."""
TRAJECTORY = ("model.seed", "data.path", "data.tokenizer", "data.bin_dtype", "data.seq_len", "data.batch_size",
              "data.global_batch_size",
              "parallel.microbatches", "optim.grad_accum", "optim.lr", "optim.weight_decay", "optim.beta1",
              "optim.beta2", "optim.eps", "optim.warmup_steps", "optim.min_lr_ratio", "optim.grad_clip",
              "training.steps", "training.seed", "training.dtype")
"""Config keys the loss trajectory of a run depends on: which tokens each step reads (data, batch, sequence
length, accumulation, data seed), what the model computes with them (initial weights' seed, precision, the
microbatch split's rounding) and how the weights move (optimizer, and ``training.steps``, which sets the
learning-rate schedule). Everything else (transports, schedule kind, activation checkpointing, timeouts,
checkpoint and metrics settings) leaves the trajectory as it is and may change on a resume."""
# Keys added after checkpoints without them were written: their value in those checkpoints.
_META_DEFAULTS: dict[str, Any] = {"tp": 1, "dp_shard": 1, "stage_shapes": None}
_CHUNK = 4 << 20


def _setting(cfg: TrainConfig, key: str) -> Any:
    section, _, name = key.partition(".")
    value = getattr(getattr(cfg, section), name)
    if key in ("data.path", "data.tokenizer") and value and value != "byte":
        value = os.path.abspath(value)  # the same file named from another working directory is the same file
    return value


def run_meta(cfg: TrainConfig, split: list[int]) -> dict[str, Any]:
    """``meta.json`` of a checkpoint of ``cfg`` with stage split ``split``."""
    p = cfg.parallel
    # a per-stage layout records its [tp, dp, dp_shard] of each stage and no uniform key (a uniform key beside a
    # per-stage list is overridden by it: recording it would record a value the run did not use); a uniform
    # layout records the uniform keys and stage_shapes None
    uniform = not cfg.per_stage
    return {"family": cfg.model.family, "flavour": cfg.model.flavour, "layers_per_stage": split,
            "dp": p.dp if uniform else None, "dp_shard": p.dp_shard if uniform else None,
            "tp": p.tp if uniform else None,
            "stage_shapes": None if uniform else [list(s) for s in cfg.stage_shapes()],
            "trajectory": {k: _setting(cfg, k) for k in TRAJECTORY}}


def crc32(path: Path) -> int:
    """CRC-32 of a file's contents, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest(folder: Path, sums: dict[str, int] | None = None) -> dict[str, Any]:
    """The marker's body for ``folder``: every file's size, and its CRC-32 (from ``sums`` where a writer already
    computed it, else read here)."""
    files = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
    known = sums or {}
    return {"files": files, "crc32": {name: known[name] if name in known else crc32(folder / name)
                                      for name in files}}


def _marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(marker, int) and not isinstance(marker, bool):
        return {}  # the first markers held the step alone
    if not isinstance(marker, dict):
        return None
    files, sums = marker.get("files", {}), marker.get("crc32", {})
    if not (isinstance(files, dict) and isinstance(sums, dict)
            and all(isinstance(v, int) for v in (*files.values(), *sums.values()))):
        return None
    return marker


def _json_problem(path: Path, name: str) -> str | None:
    """Why the JSON file ``name`` of a checkpoint is not what the trainer wrote, or None."""
    try:
        data = json.loads((path / name).read_text())
    except (OSError, ValueError):
        return f"{name} is not readable JSON"
    return None if isinstance(data, dict) else f"{name} is not a JSON object"


def damage(path: Path, verify: bool | Callable[[str], bool] = False) -> str | None:
    """Why the complete checkpoint ``path`` cannot be used, or None if it can.

    Always: the marker, every listed file's presence and size, and the JSON files' contents (small). The
    files ``verify`` selects (all with True) are also read whole against their CRC-32. A checkpoint from
    before the manifest existed (a marker with the step only) is checked for its JSON files alone.
    """
    marker = _marker(path)
    if marker is None:
        return f"its {MARKER} marker cannot be read"
    files: dict[str, int] = marker.get("files", {})
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    names = list(files) or [f.name for f in path.iterdir() if f.is_file()]
    for name in names:
        if name == "meta.json" or (name.startswith("extra-rank") and name.endswith(".json")):
            why = _json_problem(path, name)
            if why:
                return why
    sums: dict[str, int] = marker.get("crc32", {})
    for name, crc in sums.items():
        if (verify is True or (callable(verify) and verify(name))) and crc32(path / name) != crc:
            return f"{name} is not what was written: its checksum differs"
    return None


def _steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-N`` folder under ``root``, oldest first (by number: 7 digits sort right)."""
    if not root.is_dir():
        return []
    return sorted((int(p.name[5:]), p) for p in root.glob("step-*") if p.name[5:].isdigit() and p.is_dir())


def complete(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` that carry the marker, oldest first."""
    return [p for _, p in _steps(root) if (p / MARKER).is_file()]


def skipped_note(path: Path, why: str, instead: Path | None) -> str:
    """The one sentence for a damaged checkpoint passed over."""
    then = f"resuming from {instead.name} instead" if instead else \
        "no intact checkpoint is left, so the run starts from step 0"
    return f"checkpoint {path} is damaged ({why}); {then}."


def latest(folder: str | Path, warn: Callable[[str], None] | None = None,
           verify: bool | Callable[[str], bool] = False) -> Path | None:
    """The newest complete and intact checkpoint under ``folder``, or None.

    A newer one that is damaged is skipped in favour of the one before it; ``warn`` gets one sentence for it.
    """
    skipped: list[tuple[Path, str]] = []
    found = None
    for path in reversed(complete(Path(folder))):
        why = damage(path, verify)
        if why is None:
            found = path
            break
        skipped.append((path, why))
    if warn is not None:
        for path, why in skipped:
            warn(skipped_note(path, why, found))
    return found


def prune(folder: str | Path, keep_last: int) -> list[Path]:
    """Delete checkpoints older than the newest ``keep_last`` intact ones (0 keeps all); returns what went.

    Half-written and damaged folders older than the oldest kept checkpoint go too; newer ones stay.
    """
    if keep_last <= 0:
        return []
    root = Path(folder)
    intact = [p for p in reversed(complete(root)) if damage(p) is None][:keep_last]
    if len(intact) < keep_last:
        return []
    folders = [p for _, p in _steps(root)]
    gone = folders[:folders.index(intact[-1])]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def check_meta(path: Path, meta: dict[str, Any], accept_changes: bool = False,
               note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Refuse (``UserError``) a resume from ``path`` by a run of ``meta`` that has another layout, or changed
    settings of its trajectory unless ``accept_changes`` (then ``note`` gets one sentence listing them)."""
    try:
        saved = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        saved = None
    if not isinstance(saved, dict):
        raise UserError(f"checkpoint {path} has no readable meta.json; move it away to resume from the one before.")
    for key in LAYOUT:
        if key in ("dp", "dp_shard", "tp") and (saved.get("stage_shapes") or meta.get("stage_shapes")):
            continue  # per-stage (either run): stage_shapes says it all (older checkpoints recorded the keys too)
        was, now = saved.get(key, _META_DEFAULTS.get(key)), meta.get(key, _META_DEFAULTS.get(key))
        if was != now:
            raise UserError(f"checkpoint {path} is for {key}={was!r} but this run has {key}={now!r}; point "
                            "checkpoint.folder elsewhere or match the config.")
    was_t, now_t = saved.get("trajectory"), meta.get("trajectory", {})
    if not isinstance(was_t, dict):  # written before the settings were recorded: nothing to compare
        return saved
    changed = [(k, was_t[k], now_t.get(k)) for k in TRAJECTORY if k in was_t and was_t[k] != now_t.get(k)]
    if changed and not accept_changes:
        key, was, now = changed[0]
        more = f" (and {len(changed) - 1} more setting(s))" if len(changed) > 1 else ""
        raise UserError(f"checkpoint {path} was written with {key}={was!r} but this run has {key}={now!r}{more}; "
                        "a resume with it would not continue that run's loss trajectory: restore the setting, or "
                        "add --resume-changed to accept the change.")
    if changed and note is not None:
        note(f"resuming from {path} with changed settings (--resume-changed): "
             + ", ".join(f"{k} {was!r} -> {now!r}" for k, was, now in changed)
             + "; the loss trajectory is no longer that of the run that wrote it.")
    return saved
