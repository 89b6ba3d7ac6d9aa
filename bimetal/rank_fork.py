"""Ranks started as forks of the launcher, for jobs whose every rank is simulated on this machine's CPU.

A rank that starts as a new interpreter spends about three seconds of CPU importing torch and its distributed
packages (tensor, checkpoint, pipelining) before it does anything, and a simulated job starts all its ranks at
once on one machine. The launcher (``bimetal.supervisor``) imports those packages once and forks each rank
from itself: the child sets the rank's environment, its own session and standard streams, and runs the rank's
program (``-m module``, a script or ``-c``) as a fresh interpreter would, then exits with its status.

Fork is used only where it is safe and means the same: every rank simulated on the CPU (no GPU context exists
in the launcher to be copied, which ``torch.cuda.is_initialized()`` confirms) and ``BIMETAL_LAUNCH_FORK`` not
``0``. Jobs on GPUs, and any job with ``BIMETAL_LAUNCH_FORK=0``, start each rank as a new interpreter, as
torchrun does. What differs from a new interpreter, and why it does not matter to a rank: modules the
launcher imported are already imported (bimetal keeps no per-process state at import that depends on the
rank's environment: its caches hold facts of the machine), and variables a library reads only when it is
loaded keep the launcher's value, except ``OMP_NUM_THREADS``, which the child applies to torch itself (the
thread count decides how float sums are split, so the ranks' numbers depend on it). The objects the launcher
held at the fork are in the garbage collector's permanent generation in the rank (``gc.freeze``): its
collections walk only what the rank made.

A fork copies only the thread that forks: a lock any other thread of the launcher held at that instant stays
held in the child, for ever. So the supervisor forks its ranks while it has no other thread (the attempt's store
and the output pumps start after the last rank; OpenBLAS stops its own pool across a fork).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib
import io
import logging
import os
import runpy
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import IO, Any

FORK_ENV = "BIMETAL_LAUNCH_FORK"

PRELOAD = ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.pipelining",
           "torch.distributed.fsdp")
"""The torch packages a trainer rank imports, imported by the launcher before it forks."""

RANK_PRELOAD = {"bimetal.train": "bimetal.train.trainer", "bimetal.bench.gpu_ladder_rank": "bimetal.train.trainer",
                "bimetal.integrations.megatron": "megatron.core.models.gpt.gpt_model",
                "bimetal.integrations.torchtitan": "bimetal.integrations.torchtitan.cli:preload"}
"""A rank module's own heavy imports (its ``__main__`` itself must not be imported: it would run). The Megatron entry
runs a script that imports megatron-core (about 3 s of CPU per rank); its GPT model imports nearly all of it and
reads no rank's variable at import. Its CPU stand-ins are installed by each rank after the import either way.
``module:function``: a function called with the rank's arguments (after ``-m MODULE``), for a rank whose first
imports depend on them: a simulated torchtitan rank installs its CPU stand-ins and imports torchtitan's trainer and
the model its ``--module`` names (about 4 s of CPU per rank)."""


def fork_wanted(env: Mapping[str, str], simulated: bool) -> bool:
    """Whether the ranks of a job with environment ``env`` start as forks of this process."""
    if (env.get(FORK_ENV) or "").strip() == "0" or not simulated:
        return False
    if (env.get("BIMETAL_SIMULATE_DEVICE") or "cpu").strip().lower() == "cuda":
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def preload(rank_argv: list[str]) -> None:
    """Import, in the launcher, what every rank would import first (once here instead of once per rank)."""
    names = list(PRELOAD)
    if len(rank_argv) > 1 and rank_argv[0] == "-m" and rank_argv[1] in RANK_PRELOAD:
        names.append(RANK_PRELOAD[rank_argv[1]])
    for name in names:
        module, _, function = name.partition(":")
        with contextlib.suppress(ImportError):  # the rank imports it again and says what is missing
            loaded = importlib.import_module(module)
            if function:
                getattr(loaded, function)(rank_argv[2:])


class ForkedRank:
    """A forked rank, with the part of ``subprocess.Popen``'s interface the supervisor and ``RankOutput`` use."""

    def __init__(self, pid: int, args: list[str], stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid, self.args, self.stdout, self.stderr = pid, args, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None:
            raise NotImplementedError("ForkedRank.wait takes no timeout; poll it instead")
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def fork_rank(rank_argv: list[str], env: dict[str, str], pipes: bool, in_child: Callable[[], None],
              guard: Any = None) -> ForkedRank:
    """Start one rank running ``rank_argv`` (``-m module ...``, ``-c code ...`` or ``script ...``) with environment
    ``env`` in its own session; ``pipes``: its stdout and stderr are pipes read by the caller, else this process's.
    ``in_child`` runs first in the child (the parent-death signal); ``guard`` (a lock) is held across the fork so
    no thread of this process is inside a write to a stream the child inherits."""
    out_r = out_w = err_r = err_w = -1
    if pipes:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Every object this process holds now goes to the collector's permanent generation: the rank's collections
    # (each full one, and the one at its exit) then walk only its own objects, not the launcher's torch modules
    # (about 0.2 s of CPU each, and a copy of every page they touch); the collector's docs advise this before a fork.
    # This process takes its objects back at once: it collects as before.
    gc.freeze()
    with guard if guard is not None else contextlib.nullcontext():
        pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(rank_argv, env, (out_r, out_w, err_r, err_w) if pipes else None, in_child)
    gc.unfreeze()
    if pipes:
        os.close(out_w)
        os.close(err_w)
        return ForkedRank(pid, rank_argv, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
    return ForkedRank(pid, rank_argv, None, None)


def _child(rank_argv: list[str], env: dict[str, str], fds: tuple[int, int, int, int] | None,
           in_child: Callable[[], None]) -> None:
    code = 1
    try:
        # the launcher's handlers only set a flag, which a child stuck before its program runs would never read
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        # Python 3.11 keeps the launcher's thread id as the main thread's native_id in a fork child (3.12 renews
        # it); code that finds its own main thread in /proc/self/task (the GPU ladder's thread profile) needs ours.
        set_native_id = getattr(threading.current_thread(), "_set_native_id", None)
        if set_native_id is not None:
            set_native_id()
        in_child()
        if fds is not None:
            out_r, out_w, err_r, err_w = fds
            os.close(out_r)
            os.close(err_r)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
        os.environ.clear()
        os.environ.update(env)
        _threads_from(env)
        _fresh_streams(env)
        atexit._clear()  # the launcher's exit handlers are not the rank's
        code = _run(rank_argv)
        _finish()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - the child must reach os._exit whatever happened
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _threads_from(env: Mapping[str, str]) -> None:
    """torch's intra-op thread count as a new interpreter would take it from ``OMP_NUM_THREADS`` (read once, when
    the library loads, so the launcher's count would stay): it decides how float sums are split, so a rank's
    numbers depend on it."""
    torch = sys.modules.get("torch")
    raw = (env.get("OMP_NUM_THREADS") or "").strip()
    if torch is not None and raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))


def _fresh_streams(env: Mapping[str, str]) -> None:
    """New ``sys.stdout``/``sys.stderr`` on fds 1 and 2 (the inherited objects may hold the launcher's buffered
    bytes or a lock taken by one of its threads), buffered as a new interpreter would buffer them."""
    old = (sys.stdout, sys.stderr)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    new_out = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="strict",
                               line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)
    new_err = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                               line_buffering=True, write_through=unbuffered)
    sys.stdout, sys.stderr = new_out, new_err
    for logger in [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                           if isinstance(v, logging.Logger))]:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in old:
                handler.setStream(new_out if handler.stream is old[0] else new_err)


def _run(rank_argv: list[str]) -> int:
    """Run the rank's program as ``python ARGV`` would; its exit status."""
    try:
        _run_program(rank_argv)
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: BLE001 - as an interpreter: the traceback, status 1
        traceback.print_exc()
        return 1
    return 0


def _run_program(rank_argv: list[str]) -> None:
    if rank_argv[0] == "-m":
        sys.argv = [rank_argv[1], *rank_argv[2:]]
        sys.path[0] = os.getcwd()
        with warnings.catch_warnings():
            # the launcher may have imported the module itself (`bimetal topo` launches bimetal.parallel.cli):
            # runpy then warns that it exists before it runs as __main__, which a new interpreter would not say
            warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                    category=RuntimeWarning)
            runpy.run_module(rank_argv[1], run_name="__main__", alter_sys=True)
    elif rank_argv[0] == "-c":
        sys.argv = ["-c", *rank_argv[2:]]
        sys.path[0] = ""
        exec(compile(rank_argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    else:
        sys.argv = list(rank_argv)
        sys.path[0] = os.path.dirname(os.path.abspath(rank_argv[0]))
        runpy.run_path(rank_argv[0], run_name="__main__")


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What an interpreter does at exit (``Py_FinalizeEx``), in its order: ``threading._shutdown`` (the hooks
    registered with ``threading._register_atexit`` first, such as the one that tells ``concurrent.futures``' idle
    pool workers to stop, then the join of every non-daemon thread), then the ``atexit`` handlers. Joining the
    threads without those hooks first would wait forever for an idle thread-pool worker."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # an interpreter without it: the join alone
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon and t.is_alive():
                t.join()
    atexit._run_exitfuncs()
