"""`bimetal profile`: time one transformer block of a flavour on the local device, write a JSON profile.

The block is built here from the planner's dimension table (bimetal.models had not landed when this
was written); it has the same GEMMs and causal attention, so its time per token stands for a layer of
the real model. The profile records achieved FLOP/s; a cluster spec group with ``profile = "file.json"``
uses it instead of peak x efficiency. torch is imported lazily so bimetal.plan stays importable without it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bimetal.errors import UserError
from bimetal.plan import cost


def time_block(m: cost.ModelDims, seq: int, micro_batch: int, repeats: int, device: str) -> float:
    """Median seconds of forward + backward of one block on ``device``."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    hd = m.dim // m.heads
    dt = torch.float32 if device == "cpu" else torch.bfloat16

    def w(*shape: int) -> Any:
        return (torch.randn(*shape, device=device, dtype=dt) * 0.02).requires_grad_()

    wq, wk, wv, wo = w(m.dim, m.dim), w(m.kv_heads * hd, m.dim), w(m.kv_heads * hd, m.dim), w(m.dim, m.dim)
    w1, w2, w3 = w(m.ffn, m.dim), w(m.dim, m.ffn), w(m.ffn, m.dim)
    x = torch.randn(micro_batch, seq, m.dim, device=device, dtype=dt, requires_grad=True)

    def step() -> None:
        h = F.rms_norm(x, (m.dim,))
        q = (h @ wq.T).view(micro_batch, seq, m.heads, hd).transpose(1, 2)
        k = (h @ wk.T).view(micro_batch, seq, m.kv_heads, hd).transpose(1, 2)
        v = (h @ wv.T).view(micro_batch, seq, m.kv_heads, hd).transpose(1, 2)
        rep = m.heads // m.kv_heads
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        y = x + a.transpose(1, 2).reshape(micro_batch, seq, m.dim) @ wo.T
        g = F.rms_norm(y, (m.dim,))
        out = y + (F.silu(g @ w1.T) * (g @ w3.T)) @ w2.T
        out.sum().backward()

    step()  # warm-up: allocator, kernels
    times = []
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def load_profile(path: str, where: str) -> float:
    """Achieved FLOP/s from a profile file; UserError names the file and the spec key on failure."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        return float(data["achieved_flops"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{where}: key 'profile' = {path!r} is not a readable bimetal profile ({e}); "
                        "write one with `bimetal profile --out FILE`.") from None


def profile_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bimetal profile", description=__doc__)
    ap.add_argument("--model", default="debug", help=f"flavour: {', '.join(cost.MODELS)}")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", required=True, help="JSON profile to write")
    a = ap.parse_args(argv)
    if a.model not in cost.MODELS:
        raise UserError(f"unknown model flavour {a.model!r}; pass --model one of {', '.join(cost.MODELS)}.")
    import torch

    torch.set_num_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = cost.MODELS[a.model]
    t = time_block(m, a.seq, a.micro_batch, a.repeats, device)
    flops = cost.layer_flops_per_token(m, a.seq) * a.seq * a.micro_batch
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    prof = {"model": a.model, "seq": a.seq, "micro_batch": a.micro_batch, "device": name, "threads": a.threads,
            "layer_fwd_bwd_s": t, "achieved_flops": flops / t}
    Path(a.out).write_text(json.dumps(prof, indent=1))
    print(f"{a.model} block on {name}: {t * 1e3:.2f} ms fwd+bwd, {flops / t / 1e9:.2f} GFLOP/s -> {a.out}")
    return 0
