"""`bimetal profile`: time the parts of the real model on the local device and write a JSON profile.

The parts are what a pipeline stage is made of, built with ``bimetal.models.build_stage`` at the
microbatch shape the trainer will run: one transformer block, the input embedding, and the head (final
norm, output projection and the float32 cross-entropy). For each part the profile records the median
forward, backward and optimizer-update seconds (AdamW fused on a GPU, foreach on the CPU, and the
gradient-norm sum, as the trainer does), plus the memcpy bandwidth of one stage-boundary activation (what a cpu-forward
staging copy costs where "device" memory is host memory). The planner adds parts up per stage; a group
with ``profile = "file.json"`` in a cluster spec uses the block's achieved FLOP/s. torch is imported
lazily so that reading a profile needs no torch.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bimetal.args import ArgumentParser
from bimetal.errors import UserError
from bimetal.outputs import check_file, write_text
from bimetal.plan import cost
from bimetal.schema import SHAPE, check

PARTS = ("layer", "embed", "head")


def _median(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocator, kernels
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_part(m: cost.ModelDims, part: str, seq: int, micro_batch: int, repeats: int, device: str) -> dict[str, float]:
    """Median forward, backward and optimizer seconds of one stage part at ``micro_batch x seq``."""
    import torch
    import torch.nn.functional as F

    from bimetal.models import FLAVOURS, build_stage

    args = FLAVOURS[m.family][m.flavour]
    stage = build_stage(m.family, args, [0], part == "embed", part == "head", device=device, seed=0)
    if part != "layer":  # a stage must hold a layer; drop it to time the embedding or the head alone
        for key in list(stage.layers):
            del stage.layers[key]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.vocab, (micro_batch, seq), generator=gen).to(device)
    hidden = torch.randn(micro_batch, seq, m.dim, generator=gen).to(device)
    grad_out = torch.randn(micro_batch, seq, m.dim, generator=gen).to(device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    state: dict[str, Any] = {}

    def forward() -> None:
        x = ids if part == "embed" else hidden.detach().requires_grad_(True)
        out = stage(x)
        if part == "head":  # the loss is computed on the last stage, inside its forward slot
            out = F.cross_entropy(out.float().reshape(-1, m.vocab), ids.reshape(-1))
        state["out"] = out

    def backward() -> None:
        out = state.pop("out")
        out.backward() if part == "head" else out.backward(grad_out)

    def fwd_bwd() -> None:
        forward()
        backward()

    def fwd_only() -> None:
        forward()
        state.pop("out")

    decay = [p for p in stage.parameters() if p.dim() >= 2]
    other = [p for p in stage.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-4, fused=(device != "cpu") or None, foreach=(device == "cpu") or None)  # as trained

    def update() -> None:
        sq = torch.zeros((), device=device)
        for p in stage.parameters():
            if p.grad is not None:
                sq += p.grad.detach().float().pow(2).sum()
        float(sq.sqrt())
        opt.step()

    total = _median(fwd_bwd, repeats, sync)
    fwd = _median(fwd_only, repeats, sync)
    return {"fwd_s": fwd, "bwd_s": max(total - fwd, 0.0), "optim_s": _median(update, repeats, sync),
            "params": float(sum(p.numel() for p in stage.parameters()))}


def copy_gbps(nbytes: int, repeats: int) -> float:
    """Host memcpy bandwidth (GB/s) for a buffer of ``nbytes``, the cost of one cpu-forward staging copy."""
    import torch

    src = torch.randn(max(nbytes // 4, 1))
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    t = _median(copy, max(repeats, 5), lambda: None)
    return src.numel() * 4 / t / 1e9


def profile(model: str, seq: int, micro_batch: int, repeats: int = 5, threads: int = 1) -> dict[str, Any]:
    """Measure every part of ``model`` on the local device; the dict ``bimetal profile`` writes."""
    if model not in cost.MODELS:
        raise UserError(f"unknown model flavour {model!r}; pass --model one of {', '.join(cost.MODELS)}.")
    if seq < 1 or micro_batch < 1 or repeats < 1 or threads < 1:
        raise UserError(f"--seq, --micro-batch, --repeats and --threads must be positive, got {seq}, "
                        f"{micro_batch}, {repeats}, {threads}.")
    import torch

    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the trainer runs by default
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = cost.MODELS[model]
    parts = {p: time_part(m, p, seq, micro_batch, repeats, device) for p in PARTS}
    layer = parts["layer"]
    flops = cost.layer_flops_per_token(m, seq) * seq * micro_batch
    act_bytes = micro_batch * seq * m.dim * 4  # float32: the profile times float32 parts, as the CPU trains
    return {"model": model, "family": m.family, "flavour": m.flavour, "seq": seq, "micro_batch": micro_batch,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "threads": threads,
            "parts": parts, "boundary_bytes": act_bytes, "copy_gbps": copy_gbps(act_bytes, repeats),
            "layer_fwd_bwd_s": layer["fwd_s"] + layer["bwd_s"],
            "achieved_flops": flops / (layer["fwd_s"] + layer["bwd_s"])}


@dataclass(frozen=True)
class PartTimes:
    """Seconds of one part (a layer, the embedding, the head) per micro-batch, and its parameter count."""

    __pydantic_config__ = SHAPE

    fwd_s: float
    bwd_s: float
    optim_s: float
    params: float | None = None


@dataclass(frozen=True)
class ProfileRecord:
    """A ``bimetal profile`` JSON file; every key optional here, each reader requires the ones it uses."""

    __pydantic_config__ = SHAPE

    model: str | None = None
    family: str | None = None
    flavour: str | None = None
    seq: int | None = None
    micro_batch: int | None = None
    device: str | None = None
    threads: int | None = None
    parts: dict[str, PartTimes] | None = None
    boundary_bytes: int | None = None
    copy_gbps: float | None = None
    layer_fwd_bwd_s: float | None = None
    achieved_flops: float | None = None
    recorded: str | None = None
    """How and when the file was recorded (a note added by hand to shipped measurements)."""


def _read(p: Path, refuse: Callable[[str], UserError]) -> tuple[dict[str, Any], ProfileRecord]:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise refuse(f"{type(e).__name__}: {e}") from None
    try:
        return data, check(ProfileRecord, data, str(p))
    except UserError as e:
        raise refuse(str(e)) from None


def read_profile(path: str | Path) -> dict[str, Any]:
    """A profile with per-part timings; UserError names the file and what is missing or unknown."""
    p = Path(path)

    def refuse(why: str) -> UserError:
        return UserError(f"{p} is not a per-part bimetal profile ({why}); write one with "
                         "`bimetal profile --model debug --seq S --micro-batch B --out FILE`.")

    data, rec = _read(p, refuse)
    for key in ("parts", "copy_gbps", "seq", "micro_batch"):
        if getattr(rec, key) is None:
            raise refuse(f"key '{key}' is missing")
    missing = [part for part in PARTS if part not in (rec.parts or {})]
    if missing:
        raise refuse(f"key 'parts.{missing[0]}' is missing")
    return dict(data)


def load_profile(path: str, where: str) -> float:
    """Achieved FLOP/s from a profile file; UserError names the file and the spec key on failure."""
    def refuse(why: str) -> UserError:
        return UserError(f"{where}: key 'profile' = {path!r} is not a readable bimetal profile ({why}); "
                         "write one with `bimetal profile --out FILE`.")

    rec = _read(Path(path), refuse)[1]
    if rec.achieved_flops is None:
        raise refuse("key 'achieved_flops' is missing")
    return float(rec.achieved_flops)


def profile_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="bimetal profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="debug", help=f"flavour: {', '.join(cost.MODELS)}")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", required=True, help="JSON profile to write")
    a = ap.parse_args(argv)
    check_file("--out", a.out)  # before the minutes of timing
    prof = profile(a.model, a.seq, a.micro_batch, a.repeats, a.threads)
    write_text(a.out, json.dumps(prof, indent=1))
    parts = ", ".join(f"{k} {v['fwd_s'] * 1e3:.2f}+{v['bwd_s'] * 1e3:.2f}+{v['optim_s'] * 1e3:.2f} ms"
                      for k, v in prof["parts"].items())
    print(f"{a.model} on {prof['device']} (mb {a.micro_batch} x seq {a.seq}; fwd+bwd+optim): {parts}; "
          f"{prof['achieved_flops'] / 1e9:.2f} GFLOP/s per block, copy {prof['copy_gbps']:.1f} GB/s -> {a.out}")
    return 0
