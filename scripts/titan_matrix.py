"""torchtitan's own integration cases through ``bimetal titan``, against all-Gloo, and the table in docs/torchtitan.md.

    python scripts/titan_matrix.py --run pp_tp_gpipe,ddp    # run these cases here, record each outcome
    python scripts/titan_matrix.py --run all                 # every case (hours on a small CPU machine)
    python scripts/titan_matrix.py --run pp_dp_tp --logs build/titan  # and keep each run's output, every rank shown
    python scripts/titan_matrix.py --table                   # rewrite the docs table from the records

The cases are those of torchtitan's ``tests/integration_tests/features.py`` (branch ``release/0.3``, commit
``4f9e9a47``, the release pinned in ``bimetal.integrations.torchtitan.TORCHTITAN_VERSION``): each case's override
arguments, run variant after variant in one dump folder as torchtitan's ``run_tests.py`` runs them. Each case runs
twice on simulated vendors (``--simulate nvidia:N,amd:N``): with ``--all-gloo`` (every group on stock Gloo), then
with bimetal's back-ends; a pipeline of 2 (the vendor boundary) is added where a case has none, and the world is
the case's GPU count, or doubled where the case's own degrees fill it. Every run adds the CPU base arguments
(``BASE``). The outcome of a case is read from what the runs did, never assumed:

* ``identical``: both runs ended well and every variant's per-step losses are equal bit for bit (``ran``: a case
  that trains no step, such as a seed checkpoint, ended well in both with the same checkpoints written);
* ``refused``: ``bimetal titan`` refused the case in one sentence (exit 2), quoted;
* ``CUDA-only``: a rank tried to launch a Triton kernel or import Triton (absent on CPU; ``cpu_support``'s
  placeholder says so for the kernels torchtitan imports at start);
* ``differs`` / ``fails``: losses not equal, or a run failed otherwise (its first cause line quoted), or rank 0
  printed a step's line more than once;
* ``all-Gloo crashes``: bimetal's run ended well but its all-Gloo reference (every group on stock Gloo) died of a
  native crash (a rank killed by SIGSEGV, SIGABRT or SIGBUS) in each of its ``REFERENCE_TRIES`` tries, so there is
  nothing to compare with. A reference variant that dies so is run again from the dump folder as it was before it;
  one that then ends well is compared as usual, the crash noted in the detail;
* ``disabled upstream``: torchtitan's own list disables the case; not run.

Records go to ``docs/titan_matrix.json`` (one per case, with date and machine); ``--table`` renders them between the
markers in docs/torchtitan.md. Not in CI: a case costs one to several minutes here.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bimetal from this checkout

from bimetal.args import ArgumentParser  # noqa: E402
from bimetal.entry import run_command  # noqa: E402
from bimetal.errors import UserError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "titan_matrix.json"
DOC = ROOT / "docs" / "torchtitan.md"
BEGIN, END = "<!-- titan-matrix:begin -->", "<!-- titan-matrix:end -->"
BASE = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len=32",
        "--training.local_batch_size=4", "--training.steps=2", "--debug.seed=7",
        "--parallelism.spmd_backend=partial_dtensor"]
"""CPU base: a short sequence and batch, two steps (a case's own step count comes after and wins), a fixed seed,
and the DTensor back-end FSDP needs on torch 2.13 (``cli.check_supported``)."""


@dataclass
class Case:
    name: str
    variants: list[list[str]]
    ngpu: int = 4
    disabled: bool = False
    note: str = ""
    """A sentence the table adds to the case's detail: something measured about it that one run need not show."""
    args: list[list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.args = [[w for a in v for w in shlex.split(a)] for v in self.variants]


PP2 = ["--parallelism.pipeline_parallel_degree 2"]
CASES = [
    Case("default", [["--profiler.enable_profiling", "--metrics.enable_tensorboard"]]),
    Case("1d_compile", [["--compile.enable"]]),
    Case("1d_compile_sac_op", [["--compile.enable", "activation-checkpoint:selective"]]),
    Case("2d_eager", [["--parallelism.tensor_parallel_degree 2"],
                      ["--module llama3 --config llama3_debugmodel_ce_loss",
                       "--parallelism.tensor_parallel_degree 2"]]),
    Case("2d_eager_no_sp", [["--parallelism.tensor_parallel_degree 2", "--parallelism.no-enable-sequence-parallel"]]),
    Case("2d_compile", [["--compile.enable", "--parallelism.tensor_parallel_degree 2"]]),
    Case("2d_asynctp_compile", [["--compile.enable", "--parallelism.tensor_parallel_degree 2",
                                 "--compile.enable_async_tensor_parallel"]], disabled=True),
    Case("full_checkpoint", [["--checkpoint.enable"], ["--checkpoint.enable", "--training.steps 20"]]),
    Case("model_only_hf_checkpoint", [["--checkpoint.enable", "--checkpoint.folder hf_checkpoint",
                                       "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"],
                                      ["--checkpoint.enable",
                                       "--checkpoint.initial_load_path {dump}/hf_checkpoint/step-2",
                                       "--checkpoint.initial_load_model_only", "--checkpoint.initial_load_in_hf"]]),
    Case("last_save_model_only_bf16", [["--checkpoint.enable", "--checkpoint.last_save_model_only",
                                        "--checkpoint.export_dtype bfloat16"]]),
    Case("pp_1f1b", [["--parallelism.pipeline_parallel_degree 2", "--parallelism.pipeline_parallel_schedule 1F1B",
                      "--parallelism.data_parallel_shard_degree 1"]], ngpu=2),
    Case("pp_dp_1f1b", [["--parallelism.pipeline_parallel_degree 2", "--parallelism.pipeline_parallel_schedule 1F1B",
                         "--parallelism.data_parallel_shard_degree 2"],
                        ["--parallelism.pipeline_parallel_degree 2", "--parallelism.pipeline_parallel_schedule 1F1B",
                         "--parallelism.pipeline_parallel_layers_per_stage 4",
                         "--parallelism.data_parallel_shard_degree 2"]]),
    Case("pp_tp_gpipe", [["--parallelism.pipeline_parallel_degree 2", "--parallelism.pipeline_parallel_schedule GPipe",
                          "--parallelism.tensor_parallel_degree 2"]]),
    Case("pp_dp_tp", [["--checkpoint.enable", "--parallelism.pipeline_parallel_degree 2",
                       "--parallelism.data_parallel_shard_degree 2", "--parallelism.tensor_parallel_degree 2"],
                      ["--training.steps 20", "--checkpoint.enable", "--parallelism.pipeline_parallel_degree 2",
                       "--parallelism.data_parallel_shard_degree 2", "--parallelism.tensor_parallel_degree 2"]],
         ngpu=8, note="Its all-Gloo reference (stock Gloo of torch 2.13.0+cpu) dies now and then of a corrupted heap "
                      "in a Gloo worker thread (1 in 10 20-step resumes on this launcher), bimetal's run never: see "
                      "below."),
    Case("3d_compile", [["--parallelism.pipeline_parallel_degree 2", "--parallelism.data_parallel_shard_degree 2",
                         "--parallelism.tensor_parallel_degree 2", "--compile.enable"]], ngpu=8),
    Case("pp_looped_1f1b", [["--parallelism.pipeline_parallel_degree 4",
                             "--parallelism.pipeline_parallel_schedule Interleaved1F1B"],
                            ["--parallelism.pipeline_parallel_degree 4",
                             "--parallelism.pipeline_parallel_schedule Interleaved1F1B",
                             "--parallelism.pipeline_parallel_layers_per_stage 1"]]),
    Case("pp_looped_zero_bubble", [["--parallelism.pipeline_parallel_degree 4", "--parallelism.pipeline_parallel_"
                                    "schedule InterleavedZeroBubble", "activation-checkpoint:full"]], disabled=True),
    Case("pp_zbv", [["--parallelism.pipeline_parallel_degree 2", "--parallelism.pipeline_parallel_schedule "
                     "ZBVZeroBubble", "activation-checkpoint:full"]], ngpu=2, disabled=True),
    Case("pp_custom_csv", [[]], ngpu=2, disabled=True),
    Case("optimizer_bf16_states", [["--optimizer.implementation fused_opt_states_bf16"]], ngpu=2),
    Case("ddp", [["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=4"]]),
    Case("hsdp", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2"]]),
    Case("cp", [["--parallelism.context_parallel_degree=4"]]),
    Case("hsdp+tp", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2",
                      "--parallelism.tensor_parallel_degree=2"]], ngpu=8),
    # upstream: a config function of its test recipes (torchtitan_recipes.tests.llama3_debugmodel_fsdp2_cp2), absent
    # from the installed wheel; the same layout on llama3_debugmodel, as the other cp cases give it
    Case("fsdp+cp", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.context_parallel_degree=2"]]),
    Case("hsdp+cp_without_dp_shard", [["--parallelism.data_parallel_shard_degree=1",
                                       "--parallelism.data_parallel_replicate_degree=2",
                                       "--parallelism.context_parallel_degree=2"]]),
    Case("hsdp+cp_with_dp_shard", [["--parallelism.data_parallel_shard_degree=2",
                                    "--parallelism.data_parallel_replicate_degree=2",
                                    "--parallelism.context_parallel_degree=2"]], ngpu=8),
    Case("fsdp+tp+cp", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2",
                         "--parallelism.context_parallel_degree=2"]], ngpu=8),
    Case("fsdp_reshard_always", [["--parallelism.fsdp_reshard_after_forward always"]], ngpu=2),
    Case("optional_checkpoint", [["--checkpoint.enable", "--training.steps 10"],
                                 ["--checkpoint.enable",
                                  "--checkpoint.exclude_from_loading lr_scheduler,dataloader,optimizer",
                                  "--parallelism.tensor_parallel_degree 2", "--training.steps 20"]]),
    Case("gradient_accumulation", [["--training.local_batch_size 8", "--training.global_batch_size 32"]], ngpu=2),
    Case("validation_tp_cp_pp", [["--validator.enable", "--validator.dataloader.dataset c4_test",
                                  "--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=2",
                                  "--parallelism.pipeline_parallel_degree=2",
                                  "--parallelism.pipeline_parallel_schedule Interleaved1F1B"]], ngpu=8),
    Case("override_fused_swiglu", [["--override.imports torchtitan.overrides.fused_swiglu.fused_swiglu",
                                    "--parallelism.tensor_parallel_degree 2"]]),
    Case("override_fused_grouped_experts", [["--module deepseek_v3 --config deepseek_v3_debugmodel",
                                             "--override.imports torchtitan.overrides.fused_swiglu.fused_swiglu,"
                                             "torchtitan.overrides.fused_swiglu.fused_grouped_experts",
                                             "--parallelism.tensor_parallel_degree 2",
                                             "--parallelism.expert_parallel_degree 4"]]),
    Case("fsdp+varlen_attn+per_op_sac", [["--module llama3 --config llama3_debugmodel_varlen_attn",
                                          "--parallelism.data_parallel_shard_degree=4",
                                          "activation-checkpoint:selective"]]),
    Case("float8_emulate_lora", [["--module llama3 --config llama3_debugmodel_float8_emulate_lora",
                                  "--parallelism.tensor_parallel_degree 2",
                                  "--parallelism.pipeline_parallel_degree 2"]], ngpu=8),
    Case("torchcomms_3d_dp+cp+pp+compile", [[]], ngpu=8, disabled=True),
    Case("torchcomms_3d_dp+tp+pp+compile", [[]], ngpu=8, disabled=True),
    # sft: a 64-token sequence and 2 samples a batch (on BASE's 32 tokens the ranks ran 8 minutes without a step)
    Case("sft", [["--module llama3 --config sft_debugmodel", "--training.seq_len 64", "--training.local_batch_size 2"]],
         ngpu=2),
    Case("seed_checkpoint", [["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]], ngpu=1),
]
DEGREES = ("pipeline_parallel", "data_parallel_replicate", "data_parallel_shard", "context_parallel",
           "tensor_parallel", "expert_parallel")


def _degrees(args: list[str]) -> dict[str, int]:
    out = {k: (-1 if k == "data_parallel_shard" else 1) for k in DEGREES}
    for i, a in enumerate(args):
        for k in DEGREES:
            key = f"--parallelism.{k}_degree"
            if a.startswith(key + "="):
                out[k] = int(a.split("=", 1)[1])
            elif a == key and i + 1 < len(args):
                out[k] = int(args[i + 1])
    return out


def layout(case: Case) -> tuple[str, list[list[str]]]:
    """``--simulate`` and each variant's arguments: a pipeline of 2 added where the case has none (the vendor
    boundary), the world the case's GPU count (doubled where its own degrees already fill it, or where expert
    parallelism needs more of dp_shard than is left: torchtitan takes ep out of dp_shard x cp x tp)."""
    world, variants = case.ngpu, []
    for args in case.args:
        d = _degrees(args)
        if d["pipeline_parallel"] == 1 and case.ngpu > 1:
            args = [*shlex.split(PP2[0]), *args]
            d["pipeline_parallel"] = 2
            fixed = 2 * d["data_parallel_replicate"] * max(d["data_parallel_shard"], 1) * d["context_parallel"] * \
                d["tensor_parallel"]
            world = max(world, fixed)
        while d["data_parallel_shard"] == -1 and _shard(world, d) * d["context_parallel"] * d["tensor_parallel"] % \
                d["expert_parallel"]:
            world *= 2
        variants.append(args)
    if world == 1:
        return "nvidia:1", variants
    return f"nvidia:{world // 2},amd:{world - world // 2}", variants


def _shard(world: int, d: dict[str, int]) -> int:
    """dp_shard as torchtitan derives it (-1: what the other degrees leave of the world)."""
    return world // (d["pipeline_parallel"] * d["data_parallel_replicate"] * d["context_parallel"] *
                     d["tensor_parallel"])


STEP_LINE = re.compile(r"^\[rank0\]:.*\bstep:\s+(\d+)\s.*\bloss:")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _repeated_steps(stdout: str) -> list[int]:
    """Steps that rank 0 (the shown rank) printed more than one step line for."""
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, ANSI.sub("", stdout).splitlines()) if m]
    return sorted({s for s in steps if steps.count(s) > 1})


REFERENCE_TRIES = 3
"""How often the all-Gloo reference of a variant is run while it dies of a native crash (see ``native_crash``)."""
TORCH = importlib.metadata.version("torch")
NATIVE_CRASH = re.compile(r"^bimetal titan: .*\bkilled by (SIGSEGV|SIGABRT|SIGBUS)\b")


def native_crash(stderr: str) -> str | None:
    """The launcher's line naming a rank killed by SIGSEGV, SIGABRT or SIGBUS (a crash inside native code: torch
    2.13.0's stock Gloo corrupts its heap in the all-Gloo pp_dp_tp run, docs/torchtitan.md), else None."""
    return next((line for line in stderr.splitlines() if NATIVE_CRASH.match(line)), None)


def _run(simulate: str, variants: list[list[str]], dump: Path, all_gloo: bool, cwd: Path,
         logs: Path | None = None) -> dict:
    """One mode's variants in one dump folder; what each did (exit status, losses, checkpoint steps, cause, steps
    with more than one step line); with ``logs``, each run's output kept there, every rank shown.

    The all-Gloo reference of a variant that dies of a native crash is run again from the dump folder as it was
    before it (up to ``REFERENCE_TRIES`` in all), and each crash is recorded (``reference_crashes``); bimetal's own
    runs are never re-run."""
    out: list[dict] = []
    crashes: list[str] = []
    for i, args in enumerate(variants):
        before = dump.with_name(dump.name + ".before")
        shutil.rmtree(before, ignore_errors=True)
        if all_gloo and dump.exists():
            shutil.copytree(dump, before)
        for attempt in range(REFERENCE_TRIES if all_gloo else 1):
            if attempt:  # the variant again, from where the previous variant left the dump folder
                shutil.rmtree(dump, ignore_errors=True)
                if before.exists():
                    shutil.copytree(before, dump)
            record, crash = _run_variant(simulate, args, i, dump, all_gloo, cwd, logs, attempt)
            if crash is None or attempt == (REFERENCE_TRIES if all_gloo else 1) - 1:
                break
            crashes.append(crash)
        shutil.rmtree(before, ignore_errors=True)
        out.append(record)
        if record["rc"] != 0:
            break
    return {"variants": out, "reference_crashes": crashes}


def _run_variant(simulate: str, args: list[str], i: int, dump: Path, all_gloo: bool, cwd: Path,
                 logs: Path | None, attempt: int) -> tuple[dict, str | None]:
    """One run of variant ``i``: its record, and the launcher's native-crash line if it died of one."""
    args = [a.replace("{dump}", str(dump)) for a in args]
    # the dump folder before the case's arguments: after a tyro subcommand (activation-checkpoint:selective)
    # only that subcommand's options are taken
    cmd = [sys.executable, "-m", "bimetal.cli", "titan", "--simulate", simulate, *(["--all-gloo"] if all_gloo
                                                                                  else []), *BASE,
           f"--dump_folder={dump}", *args]
    world = sum(int(part.split(":")[1]) for part in simulate.split(","))
    every = ",".join(map(str, range(world)))
    shown = cmd if logs is None else [*cmd[:4], "--local-ranks-filter", every, *cmd[4:]]
    shutil.rmtree(dump / "bimetal", ignore_errors=True)
    proc = subprocess.run(shown, capture_output=True, text=True, timeout=3600, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        stem = f"{'gloo' if all_gloo else 'mixed'}-{i}" + (f".try{attempt + 1}" if attempt else "")
        (logs / f"{stem}.out").write_text(proc.stdout)
        (logs / f"{stem}.err").write_text(proc.stderr)
    reports = [json.loads(p.read_text()) for p in sorted((dump / "bimetal").glob("rank*.json"))]
    last = [r for r in reports if r["last_stage"]]
    ckpt = sorted(p.name for p in dump.rglob("step-*") if p.is_dir())
    record = {"rc": proc.returncode, "losses": [e["loss"] for e in last[0]["losses"]] if last else None,
              "checkpoints": ckpt, "cause": _cause(proc.stderr), "command": " ".join(cmd[2:]),
              "repeated_steps": _repeated_steps(proc.stdout),
              "native_crash": native_crash(proc.stderr) if proc.returncode != 0 else None}
    return record, record["native_crash"]


CAUSE = re.compile(r"^\[rank\d+\]:((?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*)$")


def _cause(stderr: str) -> str:
    """The launcher's first sentence (a refusal, or the first rank that died with its cause), else the first
    exception a shown rank printed, else the last line."""
    lines = stderr.splitlines()
    said = [line for line in lines if line.startswith("bimetal")]
    if said:
        return said[0][:400]
    for line in lines:
        m = CAUSE.match(line)
        if m:
            return m.group(1)[:300]
    return lines[-1][:300] if lines else ""


def classify(gloo: dict, mixed: dict) -> tuple[str, str]:
    """(status, detail) from the two runs' records."""
    m = mixed["variants"]
    bad = next((v for v in m if v["rc"] != 0), None)
    if bad is not None:
        if bad["rc"] == 2:
            return "refused", bad["cause"]
        if "Triton kernel" in bad["cause"] or "No module named 'triton'" in bad["cause"]:
            return "CUDA-only", bad["cause"]
        return "fails", bad["cause"]
    g = gloo["variants"]
    crashes = gloo.get("reference_crashes", [])
    if len(g) != len(m) or any(v["rc"] != 0 for v in g):
        bad = next(v for v in g if v["rc"] != 0)
        if crashes and bad.get("native_crash"):  # every try of the reference died of a native crash
            steps = sum(len(v["losses"] or []) for v in m)
            return "all-Gloo crashes", (f"bimetal's run ended well ({steps} logged step(s) over {len(m)} run(s)); its "
                                        f"all-Gloo reference (stock Gloo of torch {TORCH}) died of a native crash "
                                        f"in each of {len(crashes) + 1} tries: {bad['native_crash']}")
        return "fails", f"the all-Gloo run: {bad['cause']}"
    repeated = [v["repeated_steps"] for v in m if v["repeated_steps"]]
    if repeated:
        return "fails", f"rank 0 printed more than one step line for step(s) {repeated[0]}"
    if [v["losses"] for v in g] != [v["losses"] for v in m]:
        return "differs", f"all-Gloo {[v['losses'] for v in g]} vs {[v['losses'] for v in m]}"
    steps = sum(len(v["losses"] or []) for v in m)
    ckpt = m[-1]["checkpoints"]
    saved = f"; checkpoints {', '.join(ckpt)}" if ckpt else ""
    if steps == 0:  # nothing trained (a seed checkpoint): both ran, the same checkpoints written
        same = g[-1]["checkpoints"] == ckpt
        return ("ran" if same else "differs"), f"no training step, as the case asks{saved}"
    rerun = (f"; the all-Gloo reference (stock Gloo of torch {TORCH}) died of a native crash in {len(crashes)} "
             f"earlier tr{'y' if len(crashes) == 1 else 'ies'} and was run again ({crashes[0]})") if crashes else ""
    return "identical", f"{steps} logged step(s) over {len(m)} run(s){saved}{rerun}"


def run_cases(names: list[str], cwd: Path | None, logs: Path | None = None) -> None:
    for case in CASES:
        if case.name not in names or case.disabled:
            continue
        simulate, variants = layout(case)
        kept = logs / case.name if logs is not None else None
        with tempfile.TemporaryDirectory() as tmp:
            gloo = _run(simulate, variants, Path(tmp) / "gloo", True, cwd or ROOT, kept)
            mixed = _run(simulate, variants, Path(tmp) / "mixed", False, cwd or ROOT, kept)
        status, detail = classify(gloo, mixed)
        records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}  # read now: another run may have added
        records[case.name] = {"status": status, "detail": detail, "simulate": simulate,
                              "date": datetime.date.today().isoformat(), "machine": platform.node(),
                              "cpu_count": os.cpu_count(), "torch": TORCH,
                              "commands": [v["command"] for v in mixed["variants"]]}
        RECORDS.write_text(json.dumps(records, indent=1) + "\n")
        print(f"{case.name}: {status}: {detail}", flush=True)


def table() -> str:
    records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
    rows = ["| case | layout here | status | detail |", "|---|---|---|---|"]
    for case in CASES:
        if case.disabled:
            rows.append(f"| {case.name} | | disabled upstream | torchtitan's list disables it |")
            continue
        rec = records.get(case.name)
        if rec is None:
            rows.append(f"| {case.name} | {layout(case)[0]} | not run here yet | |")
            continue
        detail = rec["detail"].replace("|", "\\|")
        note = f". {case.note}" if case.note else ""
        rows.append(f"| {case.name} | {rec['simulate']} | {rec['status']} | {detail} ({rec['date']}){note} |")
    return "\n".join(rows)


def write_table() -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table() + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="scripts/titan_matrix.py", description=__doc__.splitlines()[0])
    p.add_argument("--run", help="cases to run, comma-separated, or 'all'")
    p.add_argument("--cwd", help="where the runs start (a torchtitan clone, for cases that read its tests/assets)")
    p.add_argument("--logs", help="keep each run's output here (<case>/{gloo,mixed}-<variant>.{out,err}), every "
                                  "rank shown")
    p.add_argument("--table", action="store_true", help="rewrite the table in docs/torchtitan.md from the records")
    opts = p.parse_args(argv)
    if opts.run:
        names = [c.name for c in CASES] if opts.run == "all" else opts.run.split(",")
        unknown = sorted(set(names) - {c.name for c in CASES})
        if unknown:
            raise UserError(f"unknown case(s) {', '.join(unknown)}; the cases are those of torchtitan's features.py "
                            "listed in docs/torchtitan.md.")
        run_cases(names, Path(opts.cwd) if opts.cwd else None, Path(opts.logs) if opts.logs else None)
    if opts.table or opts.run:
        write_table()
    return 0


if __name__ == "__main__":
    sys.exit(run_command("titan-matrix", main, sys.argv[1:]))
