"""What a checkpoint folder holds, read without torch: the marker and its manifest, damage, the newest usable
checkpoint, pruning, and what a resume must keep.

``COMPLETE`` (written last) lists every file of the checkpoint with its size and, for checkpoints written since
it was added, its CRC-32. ``damage`` says why a checkpoint cannot be used - its marker unreadable, a file
missing or cut short, a JSON file that is not what was written, a file whose contents changed - so every kind
of damage, whichever file holds it, leads to the same place: the checkpoint before it.

``scan`` is the one reading of a checkpoint folder, used by the check before ranks start (``bimetal.train.prepare``,
which reads every file) and by the ranks (``bimetal.train.checkpoint.agree_latest``, each rank the files it loads,
the ranks agreeing on each verdict): the newest usable checkpoint and every folder passed over on the way, with
why. What a checkpoint records of its run (``meta.json``) is read only through the same checks (``saved_meta``),
so a ``meta.json`` changed in place is a damaged checkpoint, never a changed config.

Nothing here deletes or replaces a checkpoint the run did not supersede itself: a resume that finds no usable
checkpoint among the ones there is refused (``Scan.refusal``), a run that is not a resume is refused where
checkpoints already are (``check_fresh``), a save whose step folder is already taken by one passed over sets
that one aside (``set_aside``) instead of replacing it, and ``prune`` removes intact checkpoints only.

``run_meta`` is what ``meta.json`` records of the config: the model, the layout and the settings the loss
trajectory depends on (``TRAJECTORY``), which a resume keeps unless told otherwise
(``checkpoint.resume_changed``), so that a resumed run continues the run that wrote the checkpoint. A checkpoint
keyed by global names (``meta.json`` ``"keys": "global"``, see ``bimetal.train.checkpoint``) may be resumed on
another layout (``LAYOUT``: pp split, dp, dp_shard, tp, per-stage shapes; and the vendor mix, which the ranks
record as ``vendors``): ``check_meta`` names the change in one sentence. One written before (no ``"keys"``)
holds per-rank state of its own ranks and is refused on any other layout. Used by the trainer and by the checks
before any rank starts.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bimetal.config import TrainConfig
from bimetal.errors import UserError

MARKER = "COMPLETE"
MODEL = ("family", "flavour")
"""``meta.json`` keys of the model: a checkpoint of another one is refused, with or without resume_changed."""
LAYOUT = ("layers_per_stage", "dp", "dp_shard", "tp", "stage_shapes")
"""``meta.json`` keys of the layout: another one is taken by a checkpoint keyed by global names (``GLOBAL``),
refused for an older one."""
GLOBAL = "global"
"""``meta.json`` ``keys`` of a checkpoint whose tensors are keyed by their names in the whole model and whose
data position and step are global (``bimetal.train.checkpoint``): it loads onto any layout."""
PER_REPLICA = ("data.batch_size", "data.global_batch_size", "parallel.microbatches")
"""Trajectory keys that say how the global batch is cut into replicas and microbatches: compared through
``global_batch`` (the rows of one accumulation step over all replicas) where the checkpoint records it."""
TRAJECTORY = ("model.seed", "data.path", "data.tokenizer", "data.bin_dtype", "data.seq_len", "global_batch",
              *PER_REPLICA, "optim.grad_accum", "optim.lr", "optim.weight_decay", "optim.beta1",
              "optim.beta2", "optim.eps", "optim.warmup_steps", "optim.min_lr_ratio", "optim.grad_clip",
              "training.steps", "training.seed", "training.dtype", "parallel.pp_boundary_dtype")
"""Config keys the loss trajectory of a run depends on: which tokens each step reads (data, batch, sequence
length, accumulation, data seed), what the model computes with them (initial weights' seed, precision, the
microbatch split's rounding, the precision of what crosses a pipeline boundary) and how the weights move
(optimizer, and ``training.steps``, which sets the learning-rate schedule). ``global_batch`` is derived (rows per
accumulation step over all replicas); the ``PER_REPLICA`` keys it comes from are compared through it where both
sides record it: a new layout keeps the trajectory by keeping the global batch, cut into its own dp replicas and
microbatches (only float rounding differs). Everything else (transports,
schedule kind, activation checkpointing, timeouts, checkpoint and metrics settings) leaves the trajectory as it
is and may change on a resume."""
# Keys added after checkpoints without them were written: their value in those checkpoints.
_META_DEFAULTS: dict[str, Any] = {"tp": 1, "dp_shard": 1, "stage_shapes": None}
_CHUNK = 4 << 20


def _setting(cfg: TrainConfig, key: str) -> Any:
    if key == "global_batch":
        return cfg.global_batch
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
    return {"keys": GLOBAL, "family": cfg.model.family, "flavour": cfg.model.flavour, "layers_per_stage": split,
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


def _is_json(name: str) -> bool:
    return name == "meta.json" or (name.startswith("extra-rank") and name.endswith(".json"))


def damage(path: Path, verify: bool | Callable[[Path, str], bool] = False) -> str | None:
    """Why the complete checkpoint ``path`` cannot be used, or None if it can.

    Always: the marker, every listed file's presence and size, and the JSON files (small): their contents and
    their CRC-32, so a ``meta.json`` changed in place is damage wherever it is read. The other files ``verify``
    selects (all with True; a callable gets the checkpoint and the file's name) are also read whole against
    their CRC-32. A checkpoint from before the manifest
    existed (a marker with the step only) is checked for its JSON files alone.
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
        if _is_json(name):
            why = _json_problem(path, name)
            if why:
                return why
    sums: dict[str, int] = marker.get("crc32", {})
    for name, crc in sums.items():
        read = _is_json(name) or verify is True or (callable(verify) and verify(path, name))
        if read and crc32(path / name) != crc:
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


def held(root: str | Path) -> list[Path]:
    """Everything under ``root`` that is a checkpoint or was one: every ``step-*`` entry (complete, unfinished,
    damaged, or set aside by ``set_aside``), by name. ``.tmp-step-*`` folders are not: a save that did not reach
    its rename holds no marker and no manifest, and the next save of its step replaces it."""
    root = Path(root)
    return sorted(root.glob("step-*")) if root.is_dir() else []


UNFINISHED = f"it has no {MARKER} marker: its save did not finish"
ASIDE = ".damaged"


@dataclass
class Scan:
    """What one reading of a checkpoint folder found (``scan``)."""

    folder: Path
    found: Path | None = None
    """The newest checkpoint that passed every check, or None."""
    passed: list[tuple[Path, str]] = field(default_factory=list)
    """Step folders newer than ``found`` (all of them without one), newest first, each with why it was passed over."""
    aside: list[Path] = field(default_factory=list)
    """Folders a save set aside earlier (``step-N.damaged``): kept for the user, never read."""

    def notes(self) -> list[str]:
        """One sentence for each folder passed over on the way to ``found``."""
        return [skipped_note(path, why, self.found) for path, why in self.passed]

    def refusal(self, who: str = "--resume") -> str | None:
        """The sentence that refuses a resume (``who``) which found no usable checkpoint among the ones in the
        folder; None where it found one, or where the folder holds none (a resume then starts from step 0)."""
        if self.found is not None or not (self.passed or self.aside):
            return None
        what = [f"{p.name}: {why}" for p, why in self.passed]
        what += [f"{p.name}: set aside as damaged by an earlier run" for p in self.aside]
        return (f"{who} found no usable checkpoint in {self.folder} ({'; '.join(what)}); nothing was changed: "
                "repair one, or move them away (or set checkpoint.folder to another folder) to start from step 0.")


def scan(folder: str | Path, verify: bool | Callable[[Path, str], bool] = False,
         agree: Callable[[Path, str | None], str | None] | None = None) -> Scan:
    """The one reading of a checkpoint folder: its step folders newest first, each read with ``damage`` (the files
    ``verify`` selects against their checksums) until one can be used.

    ``agree`` turns this process's verdict on a folder into the verdict every reader shares (the ranks of a job
    agree on each one, ``bimetal.train.checkpoint.agree_latest``); left out, the verdict is this process's own.
    A step folder without the marker is passed over as unfinished.
    """
    root = Path(folder)
    out = Scan(root, aside=[p for p in held(root) if not p.name[5:].isdigit()])
    for _, path in reversed(_steps(root)):
        why = damage(path, verify) if (path / MARKER).is_file() else UNFINISHED
        if agree is not None:
            why = agree(path, why)
        if why is None:
            out.found = path
            break
        out.passed.append((path, why))
    return out


def skipped_note(path: Path, why: str, instead: Path | None) -> str:
    """The one sentence for a damaged checkpoint passed over."""
    then = f"resuming from {instead.name} instead" if instead else "no intact checkpoint is left"
    return f"checkpoint {path} is damaged ({why}); {then}."


def latest(folder: str | Path, warn: Callable[[str], None] | None = None,
           verify: bool | Callable[[Path, str], bool] = False) -> Path | None:
    """The newest complete and intact checkpoint under ``folder``, or None (``scan``, by this process alone).

    A newer one that is damaged is skipped in favour of the one before it; ``warn`` gets one sentence for it.
    """
    found = scan(folder, verify)
    if warn is not None:
        for note in found.notes():
            warn(note)
    return found.found


def check_fresh(folder: str | Path, key: str) -> None:
    """Refuse a run that is not a resume where the checkpoint folder ``folder`` (the setting ``key``) holds
    checkpoints: its saves would replace them and pruning delete them."""
    there = held(folder)
    if there:
        names = ", ".join(p.name for p in there[:4]) + (f" and {len(there) - 4} more" if len(there) > 4 else "")
        raise UserError(f"{key}={str(folder)!r} already holds checkpoints ({names}), which this run would replace; "
                        "add --resume to continue from them, or move them away (or set checkpoint.folder to another "
                        "folder) to start from step 0.")


def set_aside(final: Path) -> Path | None:
    """Move the folder a save is about to take (one a resume passed over as damaged or unfinished) to
    ``step-N.damaged`` (``-2``, ``-3``... if taken), so no save replaces it; returns where it went, or None."""
    if not final.exists():
        return None
    target, n = final.with_name(final.name + ASIDE), 1
    while target.exists():
        n += 1
        target = final.with_name(f"{final.name}{ASIDE}-{n}")
    final.rename(target)
    return target


def prune(folder: str | Path, keep_last: int) -> list[Path]:
    """Delete intact checkpoints older than the newest ``keep_last`` intact ones (0 keeps all); returns what went.

    A damaged or unfinished folder is never deleted: it may be the only copy of its step, repairable by hand.
    """
    if keep_last <= 0:
        return []
    root = Path(folder)
    intact = [p for p in reversed(complete(root)) if damage(p) is None]
    gone = intact[keep_last:][::-1]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def saved_meta(path: Path) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint ``path``, read through its checks (``damage``): ``UserError`` for a
    checkpoint whose marker, sizes or JSON files are not what was written."""
    why = damage(path)
    if why is not None:
        raise UserError(f"checkpoint {path} is damaged ({why}); move it away to resume from the one before.")
    saved = json.loads((path / "meta.json").read_text())
    assert isinstance(saved, dict)  # damage() checked that it is a JSON object
    return saved


def moved(saved: dict[str, Any], meta: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) of each layout key (``LAYOUT``) in which ``meta`` differs from the checkpoint's ``saved``."""
    out = []
    for key in LAYOUT:
        if key in ("dp", "dp_shard", "tp") and (saved.get("stage_shapes") or meta.get("stage_shapes")):
            continue  # per-stage (either run): stage_shapes says it all (older checkpoints recorded the keys too)
        was, now = saved.get(key, _META_DEFAULTS.get(key)), meta.get(key, _META_DEFAULTS.get(key))
        if was != now:
            out.append((key, was, now))
    # the vendor mix, where both sides know it (the ranks record it; the checks before ranks start do not)
    if "vendors" in saved and "vendors" in meta and saved["vendors"] != meta["vendors"]:
        out.append(("vendors", saved["vendors"], meta["vendors"]))
    return out


def check_meta(path: Path, meta: dict[str, Any], accept_changes: bool = False,
               note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Refuse (``UserError``) a resume from ``path`` by a run of ``meta`` that has another model, another layout
    where the checkpoint is not keyed by global names, or changed settings of its trajectory unless
    ``accept_changes``; ``note`` gets one sentence for a new layout and one listing accepted changes."""
    saved = saved_meta(path)
    for key in MODEL:
        was, now = saved.get(key), meta.get(key)
        if was != now:
            raise UserError(f"checkpoint {path} is for {key}={was!r} but this run has {key}={now!r}; point "
                            "checkpoint.folder elsewhere or match the config.")
    layout = moved(saved, meta)
    if layout and saved.get("keys") != GLOBAL:
        key, was, now = layout[0]
        raise UserError(f"checkpoint {path} is for {key}={was!r} but this run has {key}={now!r}, and it was written "
                        "before checkpoints were keyed by global names, so it holds the state of its own ranks: "
                        "resume it on the layout that wrote it.")
    was_t, now_t = saved.get("trajectory"), meta.get("trajectory", {})
    if isinstance(was_t, dict):  # written before the settings were recorded: nothing to compare
        keys = [k for k in TRAJECTORY if not ("global_batch" in was_t and k in PER_REPLICA)]
        changed = [(k, was_t[k], now_t.get(k)) for k in keys if k in was_t and was_t[k] != now_t.get(k)]
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
    if layout and note is not None:
        note(f"resuming from {path} on a new layout: " + ", ".join(f"{k} {was} -> {now}" for k, was, now in layout)
             + "; the trajectory (model, global batch, data order, optimizer state) is kept.")
    return saved
