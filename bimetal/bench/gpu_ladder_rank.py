"""Rank program of ``bimetal bench gpu-ladder``: one of the two processes that share the GPU (or the CPU).

Started by the driver (``bimetal.bench.gpu_ladder``) under ``bimetal launch --simulate nvidia:1,amd:1`` with the
path of ``settings.json``. Every configuration trains the same model from the same initial weights on the same
batches, one after the other in rounds (a b c d e, a b c d e, ...):

* (a) rank 0 alone trains the whole model (rank 1 waits at a barrier, off the GPU);
* (b)-(e) rank 0 holds stage 0 and rank 1 stage 1 of a pp=2, 1F1B pipeline whose group is the configuration's
  boundary (``ideal``, ``cpu-forward``, ``device-direct`` over Mooncake TCP, ``host-copy``).

Each run resets the weights (from a host copy of the initial ones), builds a fresh AdamW and data stream, and
times ``warmup + steps`` optimizer steps (device synchronized at each step's end); peak device memory is read
per run. Before the rounds both ranks calibrate what the planner needs: each stage's forward and backward per
microbatch with the device to itself, and the link's parts (Gloo host-to-host, the copies, a small message).
Writes ``rank<R>.json`` next to ``settings.json`` (and the thread profiles with ``profile``).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import bimetal  # noqa: F401  (registers the back-ends)
from bimetal.bench.thread_profile import ThreadProfile
from bimetal.config import TrainConfig, load_config
from bimetal.models import FLAVOURS, build_model, build_stage, prune_to_stage
from bimetal.train.data import TokenStream, load_tokens
from bimetal.train.optim import build_optimizer, clip_global_norm
from bimetal.train.pipeline import PipelineRunner, StageModule, boundary_dtype, stage_layer_ids
from bimetal.train.tokenizer import build_tokenizer
from bimetal.train.trainer import _loss_fn as loss_fn  # the trainer's own loss, so every configuration is its math
from bimetal.transports import CPU_FORWARD, DEVICE_DIRECT, HOST_COPY, IDEAL

BOUNDARIES = {"b": IDEAL, "c": CPU_FORWARD, "d": DEVICE_DIRECT, "e": HOST_COPY}


def train_config(s: dict[str, Any], pp: int) -> TrainConfig:
    """The ladder's job as the trainer's config (the dry-run reads its memory terms from it)."""
    return load_config(None, {
        "model.family": "llama3", "model.flavour": s["flavour"], "parallel.pp": pp,
        "parallel.microbatches": s["microbatches"], "parallel.schedule": "1f1b",
        "parallel.layers_per_stage": s["split"] if pp > 1 else [], "data.seq_len": s["seq"],
        "data.batch_size": s["mb_size"] * s["microbatches"], "optim.lr": s["lr"], "optim.warmup_steps": 0,
        "training.dtype": s["dtype"], "training.seed": s["seed"]})


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Rank:
    """This rank's models, groups and data, and the runs it takes part in."""

    def __init__(self, s: dict[str, Any], out: Path) -> None:
        self.s, self.out = s, out
        self.phases: dict[str, float] = {"start_s": round(time.time() - _started(), 2)}
        t = time.perf_counter()
        self.dev = torch.device("cuda", 0) if s["device"] == "cuda" else torch.device("cpu")
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
        torch.set_num_threads(s["threads"])
        dist.init_process_group("gloo", timeout=timedelta(seconds=s["timeout_s"]))
        self.rank = dist.get_rank()
        self.stage, self.last = self.rank, self.rank == 1
        self.cfg = train_config(s, 2)
        self.args = FLAVOURS["llama3"][s["flavour"]]
        self.amp = torch.bfloat16 if s["dtype"] == "bfloat16" else None
        self.boundary_dtype = torch.float32
        """What stage 0 hands the schedule (``calibrate`` reads it): the dtype of the pipeline's activation examples."""
        tok = build_tokenizer(self.cfg.data.tokenizer)
        self.tokens = load_tokens(self.cfg.data.path, tok, self.cfg.data.bin_dtype)
        self.phases["init_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        self.groups, self.broken = self._groups()
        self.phases["groups_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        self.whole, self.model = self._models()
        self.init = {k: v.detach().to("cpu", copy=True) for k, v in
                     (self.whole or self.model).state_dict().items()}  # stage 0's are a subset of the whole's
        self.phases["models_s"] = round(time.perf_counter() - t, 2)

    def _groups(self) -> tuple[dict[str, Any], dict[str, str]]:
        groups: dict[str, Any] = {}
        broken: dict[str, str] = {}
        timeout = timedelta(seconds=self.s["group_timeout_s"])
        for key in self.s["configs"]:
            if key == "a":
                continue
            opts: Any = None
            if key == "b":
                opts = {"seed": self.s["seed"]}
            elif key == "d":  # Mooncake over TCP on loopback; no silent fall-back to cpu-forward
                opts = {"host": "127.0.0.1", "protocol": "tcp", "fallback": "error"}
            try:
                groups[key] = dist.new_group([0, 1], backend=BOUNDARIES[key], pg_options=opts, timeout=timeout,
                                             group_desc=f"ladder.{key}")
            except Exception as exc:  # a row that says why, not a crash: the other configurations still run
                broken[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        # both ranks skip a configuration whose group either could not build (else one would wait for the other)
        flags = torch.tensor([float(k in broken) for k in self.s["configs"]])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for k, flag in zip(self.s["configs"], flags.tolist()):
            if flag and k not in broken:
                broken[k] = "the peer rank could not build this group (its record says why)"
        return groups, broken

    def _models(self) -> tuple[Any, Any]:
        split, seed = self.s["split"], self.s["seed"]
        ids = stage_layer_ids(split, self.stage)
        if self.rank != 0 or "a" not in self.s["configs"]:
            return None, build_stage("llama3", self.args, ids, self.stage == 0, self.last, device=self.dev, seed=seed)
        whole = build_model("llama3", self.args, device=self.dev, seed=seed)
        stage = prune_to_stage(build_model("llama3", self.args, device="meta"), ids, True, False)
        stage = stage.to_empty(device=self.dev)
        stage.reset_buffers()
        full = whole.state_dict()
        stage.load_state_dict({k: full[k] for k in stage.state_dict()})  # the same weights, not a second init
        return whole, stage

    # --- calibration: what the planner's prediction needs ------------------------------------------------------
    def _median_s(self, fn: Any, repeat: int = 3) -> float:
        fn()
        times = []
        for _ in range(repeat):
            sync(self.dev)
            t0 = time.perf_counter()
            fn()
            sync(self.dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def calibrate(self) -> dict[str, Any]:
        """Each stage's forward and backward per microbatch with the device to itself (the other rank waits), and
        the link's parts: Gloo host-to-host for one boundary message, the copies, a small message's latency."""
        s, a = self.s, self.args
        mb, seq = s["mb_size"], s["seq"]
        local = self._stage_module(self.model)
        if self.stage == 0:
            x = torch.randint(0, 256, (mb, seq), device=self.dev)
        else:
            x = torch.randn(mb, seq, a.dim, device=self.dev, requires_grad=True)
        y = torch.randint(0, 256, (mb, seq), device=self.dev)
        out: dict[str, Any] = {}
        esize = torch.zeros(1)
        for turn in (0, 1):
            dist.barrier()
            if turn != self.rank:
                continue
            out["fwd_s"] = self._median_s(lambda: local(x))  # (autograd records as in training; freed unused)
            if self.stage == 0:  # what stage 0 hands the schedule is the boundary message
                esize[0] = local(x).element_size()

            def fwd_bwd() -> None:
                o = local(x)
                (loss_fn(o, y) if self.last else (o * torch.randn_like(o)).sum()).backward()
            out["fwd_bwd_s"] = self._median_s(fwd_bwd)
            out["bwd_s"] = max(0.0, out["fwd_bwd_s"] - out["fwd_s"])
            self.model.zero_grad(set_to_none=True)
        dist.broadcast(esize, 0)
        self.boundary_dtype = torch.float32 if int(esize.item()) == 4 else torch.bfloat16
        boundary = torch.zeros(mb, seq, a.dim, dtype=self.boundary_dtype)
        nbytes = boundary.numel() * boundary.element_size()
        out["boundary_bytes"] = nbytes
        host = torch.empty_like(boundary, pin_memory=self.dev.type == "cuda")
        dev_t = torch.zeros_like(boundary, device=self.dev)
        out["d2h_s"] = self._median_s(lambda: host.copy_(dev_t, non_blocking=True))
        out["h2d_s"] = self._median_s(lambda: dev_t.copy_(host, non_blocking=True))
        peer = 1 - self.rank

        def ping_pong(t: torch.Tensor, group: Any = None) -> Any:  # half of it: one message, one way
            def run() -> None:
                for turn in (0, 1):
                    (dist.send if turn == self.rank else dist.recv)(t, peer, group=group)
            return run
        dist.barrier()
        out["latency_s"] = self._median_s(ping_pong(torch.zeros(2)), 5) / 2
        out["wire_s"] = max(0.0, self._median_s(ping_pong(boundary)) / 2 - out["latency_s"])
        cf = self.groups.get("c")
        if cf is not None:  # cpu-forward's own message time (device tensors), to hold the prediction against
            out["cf_message_s"] = self._median_s(ping_pong(dev_t, cf)) / 2
        return out

    # --- one run of one configuration --------------------------------------------------------------------------
    def _reset(self, model: Any) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(self.init[k])
        model.zero_grad(set_to_none=True)

    def _stage_module(self, model: torch.nn.Module) -> StageModule:
        """The trainer's stage wrapper with the trainer's boundary dtype (``parallel.pp_boundary_dtype``)."""
        edt = boundary_dtype(self.cfg.parallel.pp_boundary_dtype, self.amp)
        return StageModule(model, self.amp, self.dev.type, edt)

    def run(self, key: str, rnd: int, profile: bool = False) -> dict[str, Any]:
        s = self.s
        dist.barrier()
        begin = time.perf_counter()
        res: dict[str, Any] = {"config": key, "round": rnd, "rank": self.rank}
        if key in self.broken or (key != "a" and key not in self.groups):
            res["error"] = self.broken.get(key, "no group")
            return res
        if key == "a" and self.rank != 0:
            dist.barrier()  # rank 0 trains alone
            res["idle"] = True
            return res
        model = self.whole if key == "a" else self.model
        group = self.groups.get(key)
        self._reset(model)
        mem0 = self._mem_start(model)  # before the runner: its buffers belong to this run
        opt = build_optimizer(model, self.cfg.optim)
        stream = TokenStream(self.tokens, s["seq"], s["mb_size"] * s["microbatches"], seed=s["seed"],
                             vocab_size=self.args.vocab_size)
        local = self._stage_module(model)
        runner = None
        n_mb, mb, seq = s["microbatches"], s["mb_size"], s["seq"]
        if key != "a":
            # shapes and dtypes only, as the trainer gives them (meta: no storage held)
            hidden = torch.empty(mb, seq, self.args.dim, device="meta", dtype=self.boundary_dtype)
            ids = torch.empty(mb, seq, dtype=torch.long, device="meta")
            logits = torch.empty(mb, seq, self.args.vocab_size, device="meta", dtype=self.boundary_dtype)
            runner = PipelineRunner(local, self.stage, 2, group, n_mb, "1f1b", loss_fn, self.dev,
                                    ids if self.stage == 0 else hidden, logits if self.last else hidden,
                                    autocast_dtype=self.amp)
            del hidden, ids, logits
        wire0 = _wire_bytes(group)
        times, losses, sent = [], [], []
        prof = None
        error = None
        try:
            for step in range(s["warmup"] + s["steps"]):
                if profile and step == s["warmup"]:
                    prof = ThreadProfile()
                    prof.start()
                if step == s["warmup"]:
                    wire0 = _wire_bytes(group)
                sync(self.dev)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                x, y = (t.to(self.dev) for t in stream.next_batch())
                if runner is not None:
                    loss = runner.step(x if self.stage == 0 else None, y if self.last else None)
                else:
                    loss = torch.zeros((), device=self.dev)
                    for xc, yc in zip(x.chunk(n_mb), y.chunk(n_mb)):
                        part = loss_fn(local(xc), yc) / n_mb
                        part.backward()
                        loss += part.detach()
                clip_global_norm(model, self.cfg.optim.grad_clip, group, 1 if runner is None else 2)
                opt.step()
                losses.append(float(loss))
                sync(self.dev)
                times.append(time.perf_counter() - t0)
                if runner is not None:
                    sent.append(runner.pipe_stage.sent_bytes)
                    runner.pipe_stage.reset_counters()
        except Exception as exc:  # the configuration fails as a row; the next runs skip it (driver: error)
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:240]}"
        res.update(step_s=times, losses=losses, sent_bytes=sent, wire_bytes=_wire_bytes(group) - wire0,
                   measured_steps=s["steps"], error=error)
        if prof is not None:
            res["profile"] = prof.stop(steps=s["steps"])
        res.update(self._mem_end(mem0))
        del runner, opt
        gc.collect()  # a pipeline stage and its schedule hold each other: free their buffers now, not later
        model.zero_grad(set_to_none=True)
        if key == "a":
            dist.barrier()  # release rank 1
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()  # the next configuration starts from the same free memory
        res["run_s"] = round(time.perf_counter() - begin, 3)
        return res

    def _mem_start(self, model: Any) -> dict[str, int]:
        if self.dev.type != "cuda":
            return {}
        own = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        torch.cuda.reset_peak_memory_stats(self.dev)
        return {"resident": torch.cuda.memory_allocated(self.dev), "own": own}

    def _mem_end(self, mem0: dict[str, int]) -> dict[str, Any]:
        """Peak device bytes of this run: the allocator's peak less what other configurations keep resident (the
        other model's weights, another group's receive slots)."""
        if not mem0:
            return {"peak_bytes": None}
        foreign = mem0["resident"] - mem0["own"]
        return {"peak_bytes": torch.cuda.max_memory_allocated(self.dev) - foreign, "foreign_bytes": foreign}


def _started() -> float:
    """When this process started (wall clock), for the report's start-up time."""
    import psutil

    return float(psutil.Process().create_time())


def _wire_bytes(group: Any) -> int:
    if group is None:
        return 0
    stats = group.comm_stats() if hasattr(group, "comm_stats") else group.counters.snapshot()
    return int(stats.get("bytes_sent", 0))


def write(r: Rank, calib: dict[str, Any], runs: list[dict[str, Any]], profiles: list[dict[str, Any]],
          partial: bool = False) -> None:
    """``rank<R>.json``: this rank's records so far (``partial`` until the last round and the profiles are in)."""
    report = {"rank": r.rank, "device": torch.cuda.get_device_name(r.dev) if r.dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "phases": r.phases, "calibration": calib, "broken": r.broken,
              "runs": runs, "profiles": profiles, "partial": partial}
    tmp = r.out / f"rank{r.rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(r.out / f"rank{r.rank}.json")


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    s = json.loads(path.read_text())
    r = Rank(s, path.parent)
    t0 = time.perf_counter()
    calib = r.calibrate()
    r.phases["calibrate_s"] = round(time.perf_counter() - t0, 2)
    runs: list[dict[str, Any]] = []
    failed: set[str] = set(r.broken)
    t0 = time.perf_counter()
    for rnd in range(s["rounds"]):
        for key in s["configs"]:
            if key in failed:
                runs.append({"config": key, "round": rnd, "rank": r.rank, "error": "failed in an earlier round"})
                continue
            res = r.run(key, rnd)
            runs.append(res)
            # both ranks drop a configuration that failed on either, so neither waits on a broken group
            bad = torch.tensor([1.0 if res.get("error") else 0.0])
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                failed.add(key)
        write(r, calib, runs, [], partial=True)  # what a run killed at its time limit still reports
    r.phases["rounds_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    profiles = []
    for key in s["profile"]:
        if key not in failed:
            res = r.run(key, -1, profile=True)
            profiles.append({"config": key, "profile": res.get("profile"), "error": res.get("error")})
    r.phases["profile_s"] = round(time.perf_counter() - t0, 2)
    write(r, calib, runs, profiles)
    dist.barrier()
    for g in r.groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from bimetal.entry import run_command

    sys.exit(run_command("bench gpu-ladder", main, sys.argv[1:]))
