"""``bimetal titan`` / ``python -m bimetal.integrations.torchtitan``: torchtitan's trainer across vendors.

    bimetal titan --module llama3 --config llama3_debugmodel --simulate nvidia:2,amd:2 \\
        --layers-per-stage 4,2 --parallelism.pipeline_parallel_degree 2 [torchtitan overrides...]

bimetal's own options are listed below; every other argument is torchtitan's (``--module``, ``--config``,
``--section.key value``) and goes to torchtitan's ``ConfigManager`` unchanged. With ``--simulate`` this
process checks the mesh, generates the CPU assets and starts one rank per simulated GPU (through torchrun);
without it, this process is one rank of a job started by ``torchrun`` or by ``srun`` (a real cluster;
``bimetal slurm --titan`` writes the sbatch script, and ``--cluster`` makes each rank check Slurm's allocation).
Precedence: torchtitan CLI overrides > ``--plan`` file > the ``--config`` function's values.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import logging.handlers
import os
import re
import sys
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bimetal import transports
from bimetal.args import ArgumentParser
from bimetal.env import check_needs
from bimetal.env import read as read_env
from bimetal.errors import UserError
from bimetal.outputs import check_folder
from bimetal.plan.titan_split import module_fqns_per_model_part, parse_split
from bimetal.topology import slurm


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="bimetal titan", description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("--simulate", help="simulated vendors by global rank, e.g. nvidia:2,amd:2 (CPU, this machine)")
    p.add_argument("--cpu", action="store_true", help="install the CPU stand-ins without simulating (one rank)")
    p.add_argument("--pp-transport", choices=transports.BIMETAL,
                   help=f"transport of pp groups that span vendors (default: {transports.DEFAULT}, "
                        "or the --plan file's)")
    p.add_argument("--layers-per-stage", help="uneven layer split, one count per pipeline rank, e.g. 4,2")
    p.add_argument("--plan", help="a `bimetal plan --write-titan` file: torchtitan overrides and the split")
    p.add_argument("--all-gloo", action="store_true",
                   help="reference run: every group on plain Gloo, no vendor rules (with --simulate only)")
    p.add_argument("--assets", help="folder for the generated CPU tokenizer and dataset (default: "
                                    "<dump_folder>/bimetal_assets)")
    p.add_argument("--cluster", help="cluster spec the job is laid out on (`bimetal slurm --titan` passes it): under "
                                     "srun each rank checks Slurm's allocation against it before training")
    p.add_argument("--local-ranks-filter", default="0",
                   help="with --simulate: the ranks whose output is shown, each line prefixed [rank<R>]: (torchrun's "
                        "option, as torchtitan's launch script sets it; default 0, e.g. 0,3)")
    return p


def _given(args: list[str], key: str) -> bool:
    return any(a == f"--{key}" or a.startswith(f"--{key}=") for a in args)


RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torchrun's contract (``srun`` tasks get it from ``bimetal.topology.slurm``): a rank needs all of it."""

PER_STAGE = ("tp_per_stage", "dp_per_stage", "dp_shard_per_stage")
"""bimetal train's per-stage shape keys: torchtitan's meshes are uniform, so ``bimetal titan`` refuses them."""


def _refuse_per_stage(titan_args: list[str], plan: dict[str, Any]) -> None:
    """One sentence if the command line or the ``--plan`` file asks for per-stage shapes."""
    named = [a.split("=")[0] for a in titan_args for key in PER_STAGE
             if a.lstrip("-").split("=")[0] in (key, f"parallel.{key}", key.replace("_", "-"))]
    named += [f"[bimetal] {key} in the plan file" for key in PER_STAGE if plan.get("bimetal", {}).get(key)]
    if named:
        raise UserError(f"per-stage shapes ({named[0]}) cannot run under torchtitan, whose meshes give every "
                        "pipeline stage the same tp, dp and dp_shard; use bimetal train for them, or a uniform plan "
                        "here.")


def _read_plan(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"cannot read the plan file {path!r}: {exc}") from exc


def _plan_args(plan: dict[str, Any], titan_args: list[str]) -> list[str]:
    """The plan's scalar torchtitan overrides as CLI arguments, for keys the command line does not set."""
    out = []
    for key, value in plan.get("torchtitan", {}).items():
        if key == "parallelism.module_fqns_per_model_part" or _given(titan_args, key):
            continue
        if isinstance(value, bool):  # torchtitan's parser takes booleans as --a.b / --a.no-b
            section, _, name = key.rpartition(".")
            out.append(f"--{key}" if value else f"--{section}.no-{name}")
            continue
        out.append(f"--{key}={value}")
    for flag in ("module", "config"):
        if flag in plan.get("bimetal", {}) and not _given(titan_args, flag):
            out.append(f"--{flag}={plan['bimetal'][flag]}")
    return out


def _dump_folder(titan_args: list[str]) -> str:
    for i, a in enumerate(titan_args):
        if a.startswith("--dump_folder="):
            return a.split("=", 1)[1]
        if a == "--dump_folder" and i + 1 < len(titan_args):
            return titan_args[i + 1]
    return "./outputs"


def load_config(titan_args: list[str], cpu: bool, split: list[int] | None) -> Any:
    """torchtitan's config from its own parser, then the split (recomputed for the schedule in use: a plan's
    per-rank counts also fit an interleaved run) and, on CPU, the attention stand-in."""
    config = parse_titan_args(titan_args)
    par = config.parallelism
    if split is not None:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        if len(split) != par.pipeline_parallel_degree:
            raise UserError(f"--layers-per-stage has {len(split)} entries but parallelism.pipeline_parallel_degree "
                            f"is {par.pipeline_parallel_degree}; give one layer count per pipeline rank")
        try:
            single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
        except ValueError as exc:
            raise UserError(f"parallelism.pipeline_parallel_schedule: {exc}") from exc
        n_layers = len(config.model_spec.model.layers)
        par.module_fqns_per_model_part = module_fqns_per_model_part(
            n_layers, split, 1 if single else 2, par.pipeline_parallel_schedule)
    if cpu:
        from bimetal.integrations.torchtitan import cpu_support

        cpu_support.use_sdpa_attention(config.model_spec.model)
    return config


_BOX_RULE = re.compile(r"^[\s\u2500-\u257f+|-]*$")
"""A line of tyro's error box that is all border (rich draws it with box characters, or ASCII off a terminal)."""


def parse_titan_args(titan_args: list[str]) -> Any:
    """torchtitan's ``ConfigManager().parse_args``; what it refuses becomes one sentence (``UserError``).

    tyro, torchtitan's parser, prints a box of a dozen lines or more (title, message, help text, the program's
    whole argument list for a misspelled key) and exits: the box is caught and read for its message and tyro's
    suggestion, which name only what the user typed (``Unrecognized options: --training.step=2``, ``Perhaps you
    meant: --training.steps``)."""
    from torchtitan.config import ConfigManager

    box = io.StringIO()
    try:
        # a wide page, so rich does not wrap the message inside the box
        with _environ(COLUMNS="4000"), contextlib.redirect_stderr(box), contextlib.redirect_stdout(box):
            return ConfigManager().parse_args(titan_args)
    except SystemExit as exc:
        if not exc.code:  # --help: tyro's page is what was asked for
            sys.stdout.write(box.getvalue())
            raise
        raise UserError(_box_sentence(box.getvalue())) from None
    except (ValueError, ImportError) as exc:
        raise UserError(f"torchtitan: {exc}") from exc


def _box_sentence(text: str) -> str:
    """One sentence from tyro's error box: its first message line, plus the first option it suggests."""
    parts: list[list[str]] = [[]]
    for raw in text.splitlines():
        line = raw.strip().strip("\u2502|").strip()
        if _BOX_RULE.match(raw) or not line:
            if parts[-1]:
                parts.append([])
            continue
        parts[-1].append(line)
    # parts: [title], [message...], [help or suggestions...], ...; lines logged before the box come first
    titled = [i for i, p in enumerate(parts) if p and p[-1] in _TYRO_TITLES]
    body = parts[titled[0] + 1:] if titled else parts
    message = " ".join(body[0]) if body and body[0] else "torchtitan refused its arguments"
    sentence = f"torchtitan: {message.rstrip('.')}"
    for part in body[1:]:
        if part and part[0].startswith("Perhaps you meant"):
            options = [w for line in part[1:] for w in line.split() if w.startswith("--")]
            if options:
                sentence += f"; did you mean {options[0]}?"
                return sentence
    return sentence + "."


_TYRO_TITLES = ("Value error", "Unrecognized options", "Missing argument", "Parsing error", "Required options",
                "Invalid subcommand", "Missing subcommand", "Ambiguous option")


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


CP_ON_CPU = ("context parallelism (parallelism.context_parallel_degree > 1) cannot run on a CPU: torchtitan shards "
             "attention over cp only as FlexAttention (no backward on CPU) or SDPA through torch's context-parallel "
             "dispatcher, which in torch {torch} handles the GPU kernels alone (flash, efficient, cuDNN), not the "
             "CPU's _scaled_dot_product_flash_attention_for_cpu; run it on GPUs.")
"""Measured: the ranks of a cp=2 job on ``ScaledDotProductAttention`` fail with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"."""


COMPILE_TP_ON_CPU = ("--compile.enable with tensor parallelism fails on CPU inside torch {torch}'s AOTAutograd (a "
                     "DTensor's DeviceMesh among the values it saves for backward: \"expected all "
                     "tensors_saved_with_vc_check to be Tensors\"); drop --compile.enable or tensor parallelism here.")
"""Measured (torch 2.13, torchtitan 0.3.0): ``--compile.enable --parallelism.tensor_parallel_degree 2`` on
``--simulate nvidia:2``, Inductor, both ranks fail in the first step in ``save_from_forward``."""


def check_supported(config: Any, world: int, cpu: bool = False) -> None:
    """Refuse, in one sentence, a combination measured to fail with torch 2.13 (rather than a traceback later)."""
    import torch

    par = config.parallelism
    version = torch.__version__.split("+")[0]
    if cpu and par.context_parallel_degree > 1:
        raise UserError(CP_ON_CPU.format(torch=version))
    if cpu and config.compile.enable and par.tensor_parallel_degree > 1:
        raise UserError(COMPILE_TP_ON_CPU.format(torch=version))
    if cpu and config.optimizer.implementation == "fused_opt_states_bf16":
        raise UserError(f"--optimizer.implementation fused_opt_states_bf16 keeps Adam's states in bfloat16 beside "
                        f"float32 parameters, which torch {version}'s fused AdamW takes on GPUs "
                        "only (on CPU: \"expected scalar type Float but found BFloat16\"); use fused or foreach here.")
    if config.checkpoint.create_seed_checkpoint:
        fixes = ["run it on one rank (e.g. --simulate nvidia:1)"] if world != 1 else []
        fixes += [] if config.checkpoint.enable else ["add --checkpoint.enable"]
        if fixes:
            raise UserError("--checkpoint.create_seed_checkpoint writes the step-0 checkpoint from one unsharded rank, "
                            f"as torchtitan requires: {' and '.join(fixes)}.")
    rest = par.pipeline_parallel_degree * par.data_parallel_replicate_degree * par.context_parallel_degree
    shard = par.data_parallel_shard_degree if par.data_parallel_shard_degree > 0 else world // max(
        rest * par.tensor_parallel_degree, 1)
    ep, spread = par.expert_parallel_degree, shard * par.context_parallel_degree * par.tensor_parallel_degree
    if ep > 1 and spread % ep:  # torchtitan's mesh then has an expert-FSDP dimension of size 0 (a ValueError per rank)
        raise UserError(f"parallelism.expert_parallel_degree={ep} must divide dp_shard x cp x tp, which is {shard} x "
                        f"{par.context_parallel_degree} x {par.tensor_parallel_degree} = {spread} on these {world} "
                        "ranks (torchtitan takes the expert ranks from them); choose a divisor, or more ranks.")
    if shard > 1 and par.spmd_backend == "spmd_types" and torch.__version__.startswith("2.13"):
        raise UserError("FSDP (data_parallel_shard_degree > 1) with parallelism.spmd_backend=spmd_types fails inside "
                        "fully_shard on torch 2.13 with torchtitan 0.3.0; pass "
                        "--parallelism.spmd_backend=partial_dtensor")


def _module_name(titan_args: list[str]) -> str:
    for i, a in enumerate(titan_args):
        if a.startswith("--module="):
            return a.split("=", 1)[1]
        if a == "--module" and i + 1 < len(titan_args):
            return titan_args[i + 1]
    raise UserError("--module is required, e.g. --module llama3 --config llama3_debugmodel")


@contextlib.contextmanager
def held_back(show: bool = True) -> Iterator[None]:
    """What torchtitan (and torch) log or warn while bimetal checks a run is held back: shown once every check
    passed, dropped when one refuses the run, so a refusal is its one sentence. ``show=False``: dropped in any case
    (the launcher of a simulated job, whose ranks parse the same arguments and log the same lines, prefixed with
    their rank). torchtitan (and torchao, which it imports) log through the root logger; torch through its own
    ``torch`` logger, which does not pass records on to the root."""
    root, torch_log = logging.getLogger(), logging.getLogger("torch")
    buffer = logging.handlers.BufferingHandler(capacity=1 << 16)
    saved, root.handlers = root.handlers, [buffer]
    saved_torch, torch_log.handlers = torch_log.handlers, [buffer]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        except UserError:
            buffer.buffer.clear()
            caught.clear()
            raise
        finally:
            # torchtitan's init_logger, run inside, replaces the handlers: keep its; else put ours back
            root.handlers = saved if root.handlers == [buffer] else [h for h in root.handlers if h is not buffer]
            torch_log.handlers = saved_torch
    if not show:
        return
    handlers = root.handlers or ([logging.lastResort] if logging.lastResort else [])
    for record in buffer.buffer:
        from_torch = record.name == "torch" or record.name.startswith("torch.")
        if from_torch or record.levelno >= root.getEffectiveLevel():
            for handler in (saved_torch if from_torch else handlers):
                if record.levelno >= handler.level:
                    handler.handle(record)
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def check_outputs(config: Any) -> None:
    """torchtitan's output folders that this run writes can be created and written (one sentence otherwise)."""
    dump = config.dump_folder
    check_folder("--dump_folder", dump)
    if config.checkpoint.enable:
        check_folder("--checkpoint.folder", os.path.join(dump, config.checkpoint.folder))
    if config.metrics.enable_tensorboard:
        check_folder("--metrics.save_tb_folder", os.path.join(dump, config.metrics.save_tb_folder))


def main(argv: list[str]) -> int:
    opts, titan_args = build_parser().parse_known_args(argv)
    # A task of an srun step is a rank: Slurm's variables become torchrun's (bimetal.topology.slurm).
    slurm_job = None if opts.simulate else slurm.adopt()
    if opts.all_gloo and not opts.simulate and not read_env("BIMETAL_SIMULATE"):
        raise UserError("--all-gloo is a reference for simulated runs; it needs --simulate")
    if opts.assets and not opts.simulate:
        raise UserError("--assets is where --simulate writes its CPU tokenizer and dataset; add --simulate or drop "
                        "it (without --simulate give torchtitan's --hf_assets_path and --dataloader.dataset_path).")
    if opts.cpu and opts.simulate:
        raise UserError("--cpu installs the CPU stand-ins for one rank without --simulate; --simulate installs them "
                        "already: drop --cpu.")
    _refuse_per_stage(titan_args, _read_plan(opts.plan))  # before anything is installed or written
    check_needs(simulated=bool(opts.simulate or read_env("BIMETAL_SIMULATE")))
    check_folder("--dump_folder", _dump_folder(titan_args))  # before torchtitan's slow import
    plan = _read_plan(opts.plan)
    titan_args = _plan_args(plan, titan_args) + titan_args
    split = parse_split(opts.layers_per_stage) if opts.layers_per_stage else None
    if split is None and plan.get("bimetal", {}).get("layers_per_stage"):
        split = [int(x) for x in plan["bimetal"]["layers_per_stage"]]
    pp_transport = opts.pp_transport or plan.get("bimetal", {}).get("pp_transport", transports.DEFAULT)
    if opts.simulate:
        return _launch_simulated(opts, titan_args, split, pp_transport)
    if slurm_job is not None and opts.cluster:
        _check_slurm(slurm_job, opts.cluster, plan.get("bimetal", {}).get("stage_groups"))
    cpu = opts.cpu or bool(read_env("BIMETAL_SIMULATE"))
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"without --simulate or --cpu this is one rank of a GPU job, but this torch "
                            f"({torch.__version__}) sees no GPU; add --simulate (e.g. nvidia:1,amd:1) or --cpu.")
    missing = [k for k in RANK_ENV if not os.environ.get(k)]
    if missing:
        raise UserError(f"without --simulate this process is one rank of a job that torchrun or srun starts, but "
                        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; start it with "
                        "`torchrun --nproc-per-node N -m bimetal.integrations.torchtitan ...`, or add --simulate "
                        "(e.g. nvidia:1,amd:1) to run on this machine's CPU.")
    return run_rank(titan_args, cpu=cpu, split=split,
                    pp_transport=pp_transport, all_gloo=opts.all_gloo)


def _check_slurm(job: slurm.SlurmJob, cluster: str, stage_groups: list[str] | None) -> None:
    """Slurm's allocation against the cluster spec, components in the plan's stage order, before torchtitan."""
    from bimetal.plan.sbatch import islands
    from bimetal.plan.spec import load_spec
    from bimetal.topology.vendor import detect_vendor

    vendor = detect_vendor(job.task.rank if job.task else None)
    slurm.check_allocation(islands(load_spec(cluster), stage_groups), job, f"cluster spec {cluster}", vendor=vendor)


def _launch_simulated(opts: argparse.Namespace, titan_args: list[str], split: list[int] | None,
                      pp_transport: str) -> int:
    from bimetal.integrations.torchtitan import cpu_support
    from bimetal.integrations.torchtitan.mesh import preflight
    from bimetal.launch import launch
    from bimetal.rank_output import RankOutput, parse_filter
    from bimetal.topology.vendor import parse_simulate

    try:
        vendors = parse_simulate(opts.simulate)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    output = RankOutput(parse_filter(opts.local_ranks_filter, len(vendors)))
    assets = Path(opts.assets or Path(_dump_folder(titan_args)) / "bimetal_assets")
    check_folder("--assets" if opts.assets else "--assets (default <dump_folder>/bimetal_assets)", assets)
    # The paths only: the assets are written once every check has passed (a refused run writes nothing).
    tok_dir, data_dir = assets / "tokenizer", assets / "c4_test"
    if not _given(titan_args, "training.disable_cuda_graphs"):  # no CUDA graphs on CPU
        titan_args = ["--training.disable_cuda_graphs"] + titan_args
    with held_back(show=False):  # the ranks log the same; the assets are written below, once the checks pass
        # torchtitan's model imports torchao, whose CUDA kernels fail to load on a CPU with a warning each
        cpu_support.install(_module_name(titan_args))
        config = load_config(titan_args, cpu=True, split=split)
        titan_args = asset_args(config, titan_args, tok_dir, data_dir) + titan_args
        check_supported(config, len(vendors), cpu=True)
        check_outputs(config)
        par = config.parallelism
        degrees = {"pp": par.pipeline_parallel_degree, "dp_replicate": par.data_parallel_replicate_degree,
                   "dp_shard": par.data_parallel_shard_degree, "cp": par.context_parallel_degree,
                   "tp": par.tensor_parallel_degree}
        if not opts.all_gloo:
            preflight(degrees, vendors, pp_transport, simulated=True)
    if (tok_dir, data_dir) != cpu_support.write_assets(assets):
        raise RuntimeError(f"cpu_support.write_assets wrote elsewhere than {tok_dir} and {data_dir}")
    rank_argv = ["-m", "bimetal.integrations.torchtitan", f"--pp-transport={pp_transport}"]
    if split is not None:
        rank_argv.append(f"--layers-per-stage={','.join(map(str, split))}")
    if opts.all_gloo:
        rank_argv.append("--all-gloo")
    code = launch(rank_argv + titan_args, simulate=opts.simulate, name="bimetal titan", output=output,
                  extra_env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return code


def asset_args(config: Any, titan_args: list[str], tok_dir: Path, data_dir: Path) -> list[str]:
    """The generated CPU assets as torchtitan arguments, for what the run would otherwise look for in torchtitan's
    source tree (``tests/assets``, not in its wheel) and not find: the tokenizer, and the ``c4_test`` text dataset of
    the training and validation loaders. A path the user gave, or one that exists from here (a run in a torchtitan
    clone), is kept. A loader of another kind (``sft``'s chat loader) reads its own files: it is left as configured,
    and files of it that do not exist are refused in one sentence."""
    out = []
    if not _given(titan_args, "hf_assets_path") and not Path(config.hf_assets_path or "").exists():
        out.append(f"--hf_assets_path={tok_dir}")
    loaders = [("dataloader", config.dataloader)]
    if config.validator.enable:
        loaders.append(("validator.dataloader", config.validator.dataloader))
    for key, loader in loaders:
        if _given(titan_args, f"{key}.dataset_path"):
            continue
        if getattr(loader, "dataset", None) == "c4_test":
            if not Path(loader.dataset_path or "tests/assets/c4_test").exists():
                out.append(f"--{key}.dataset_path={data_dir}")
            continue
        files = (getattr(loader, "load_dataset_kwargs", None) or {}).get("data_files")
        missing = [f for f in ([files] if isinstance(files, str) else files or []) if not Path(f).exists()]
        if missing:
            raise UserError(f"the {key} of this config reads {missing[0]!r}, which does not exist from "
                            f"{os.getcwd()}; run it from a torchtitan source tree (its tests/assets) or give the "
                            "config your own data.")
    return out


class SetupOnce(logging.Filter):
    """Passes each warning of a rank's set-up once: torchtitan's config classes note their defaults when they are
    built (``initial_load_model_only=True has no effect without an initial_load_path``), and torchtitan builds the
    config three times before training (the ``--config`` function, its parser, the trainer)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def run_rank(titan_args: list[str], cpu: bool, split: list[int] | None, pp_transport: str,
             all_gloo: bool = False) -> int:
    """One rank: torchtitan's training loop (as its ``train.main``) on a ``BimetalTrainer``."""
    import torch

    from bimetal.topology.local_device import bind_rank_device

    bind_rank_device()  # first: one sentence when LOCAL_RANK has no GPU, before torchtitan or any group starts
    if cpu:
        from bimetal.integrations.torchtitan import cpu_support

        torch.set_num_threads(1)
        cpu_support.install(_module_name(titan_args))
    from torchtitan.tools.logging import init_logger

    from bimetal.integrations.torchtitan import _torch_compat
    from bimetal.integrations.torchtitan.trainer import BimetalOptions, BimetalTrainer

    _torch_compat.install()
    once = SetupOnce()  # torchtitan builds its config (and its notes about defaults) again at each set-up stage
    logging.getLogger().addFilter(once)
    trainer = None
    try:
        with held_back():
            config = load_config(titan_args, cpu=cpu, split=split)
            check_supported(config, int(os.environ.get("WORLD_SIZE", "1")), cpu=cpu)
            check_outputs(config)
            init_logger()  # torchtitan's log format from here on (what was held back is shown in it)
        trainer = BimetalTrainer(config, BimetalOptions(pp_transport=pp_transport, all_gloo=all_gloo, cpu=cpu))
        logging.getLogger().removeFilter(once)  # training's own warnings, repeated or not, are torchtitan's to show
        if config.checkpoint.create_seed_checkpoint:  # torchtitan's train.main: step 0 saved, nothing trained
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logging.getLogger().info("Created seed checkpoint")
        else:
            trainer.train()
        trainer.report()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


def preload(rank_args: list[str]) -> None:
    """What a simulated rank of ``rank_args`` does first (``run_rank`` with ``cpu``: the CPU stand-ins, torchtitan's
    trainer and the ``--module`` model imported), done once by a launcher that forks its ranks
    (``bimetal.rank_fork.RANK_PRELOAD``), as ``bimetal titan --simulate`` does before it launches. What torchtitan logs
    while it is imported is dropped, as that launcher drops it. Without ``--module`` nothing is done (the
    rank refuses the run itself)."""
    from bimetal.integrations.torchtitan import cpu_support

    try:
        module = _module_name(rank_args)
    except UserError:
        return
    with held_back(show=False):
        cpu_support.install(module)


def rank_main() -> int:
    """``python -m bimetal.integrations.torchtitan``: errors a user can cause end in one sentence, exit 2."""
    from bimetal.integrations.common import rank_entry  # the rank's imports, not the argument check's

    return rank_entry(main, "bimetal titan")
