"""Writing an HF model folder so that it holds exactly one model: shards, index, and replacing an older export.

A reader picks the weights of a folder by file name: transformers takes ``model.safetensors`` before
``model.safetensors.index.json``, ``bimetal.models.from_hf`` the index first. A folder holding both (an older
sharded export under a newer single file, or the reverse) silently loads whichever the reader prefers. So an
export is written whole into a new folder beside the target and then swapped with it in one rename
(``renameat2(RENAME_EXCHANGE)``, else two renames): readers see the old model or the new one, and afterwards the
folder holds the new model alone. What the old folder held besides its model (a tokenizer, a README) is carried
over untouched; weights in another format (``pytorch_model.bin``, ``*.gguf``, a safetensors file no index names)
would leave two models, so such a folder is refused in one sentence before anything is written. Where the
folder's parent cannot be written (the folder is a mount point, say) the files are staged inside it and moved in
one by one, stale index first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bimetal.errors import UserError
from bimetal.outputs import check_folder, umask

MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# Weight files of other formats and names that a reader could take for the model.
_WEIGHTS = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|\.pt|\.pth|\.h5|\.msgpack|"
                      r"\.gguf|\.ckpt(\.index)?)$")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _old_model(folder: Path) -> set[str]:
    """Names of the files that make up the model now in ``folder`` (replaced by an export)."""
    names = {n for n in (CONFIG_FILE, MODEL_FILE, INDEX_FILE) if (folder / n).exists()}
    names |= {p.name for p in folder.iterdir() if _SHARD.match(p.name)}
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text()).get("weight_map", {})
        names |= {str(f) for f in weight_map.values() if "/" not in str(f)}
    except (OSError, ValueError, AttributeError):
        pass  # no index, or one that is not JSON: its own name is in the set and goes with the old model
    return names


def export_problem(path: str | Path) -> str | None:
    """Why an export into ``path`` would leave more than one model there, or None."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    old = _old_model(folder)
    foreign = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in old and _WEIGHTS.search(p.name))
    if foreign:
        return (f"{folder} holds {foreign[0]}, weights bimetal did not write; an export beside them would leave two "
                "models in one folder: move them away or export elsewhere")
    return None


def check_export(key: str, path: str | Path) -> None:
    """Refuse, naming ``key``, an export folder that cannot be written or that holds other weights."""
    check_folder(key, path)
    why = export_problem(path)
    if why is not None:
        raise UserError(f"{key}={str(path)!r}: {why}.")


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in file order, cut into files of at most ``max_bytes`` (a larger tensor alone); 0: one file."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_bytes and out[-1] and size + n > max_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += n
    return out


def _write_model(folder: Path, tensors: dict[str, torch.Tensor], config_text: str, max_bytes: int) -> list[str]:
    """Weights (one file, or shards + index), then ``config.json``, into ``folder``; returns the names, in the order
    they are to be moved into place (the index after its shards, the config last)."""
    shards = _shards(tensors, max_bytes)
    names = []
    if len(shards) == 1:
        save_file(shards[0], str(folder / MODEL_FILE), metadata={"format": "pt"})
        names.append(MODEL_FILE)
    else:
        weight_map: dict[str, str] = {}
        for i, part in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, str(folder / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, name)
            names.append(name)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2) + "\n")
        names.append(INDEX_FILE)
    (folder / CONFIG_FILE).write_text(config_text)
    for name in names:  # safetensors writes 0600; an exported model is for others to read, as the config is
        os.chmod(folder / name, 0o666 & ~umask())
    return [*names, CONFIG_FILE]


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux ``renameat2``); False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _carry_over(old: Path, new: Path, skip: set[str]) -> None:
    """Hard-link (else copy) what ``old`` holds besides its model into ``new``."""
    for entry in old.iterdir():
        if entry.name in skip:
            continue
        target = new / entry.name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(target))


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _beside_possible(folder: Path) -> bool:
    parent = folder.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return False
    return not (folder.exists() and (os.path.ismount(folder) or folder.stat().st_dev != parent.stat().st_dev))


def write_model_folder(path: str | Path, tensors: dict[str, torch.Tensor], config_text: str,
                       max_shard_bytes: int = 0) -> Path:
    """Make ``path`` an HF folder holding these tensors and ``config.json`` as its only model; returns it."""
    check_export("export folder", path)
    folder = Path(os.path.realpath(path))  # a link to a folder: the folder it names is replaced, the link kept
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not _beside_possible(folder):
        return _write_inside(folder, tensors, config_text, max_shard_bytes)
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.bimetal-export-"))
    try:
        _write_model(stage, tensors, config_text, max_shard_bytes)
        if not folder.exists():
            os.chmod(stage, 0o777 & ~umask())  # mkdtemp's folder is 0700
            os.rename(stage, folder)
            return folder
        _carry_over(folder, stage, _old_model(folder))
        os.chmod(stage, folder.stat().st_mode & 0o7777)
        if not _exchange(stage, folder):  # the folder is briefly absent between the two renames
            old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.bimetal-old-"))
            os.rmdir(old)
            os.rename(folder, old)
            os.rename(stage, folder)
            stage = old
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # the old folder after a swap, the half-written one after a failure
    return folder


def _write_inside(folder: Path, tensors: dict[str, torch.Tensor], config_text: str, max_shard_bytes: int) -> Path:
    """The export staged in a hidden folder inside ``folder`` and moved in file by file: the old index goes
    first (a reader never pairs it with new shards), then the new files, then what is left of the old model."""
    folder.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder, prefix=".bimetal-export-"))
    try:
        names = _write_model(stage, tensors, config_text, max_shard_bytes)
        old = _old_model(folder) - set(names)
        with contextlib.suppress(FileNotFoundError):
            (folder / INDEX_FILE).unlink()
        for name in names:
            os.replace(stage / name, folder / name)
        for name in old:
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return folder
