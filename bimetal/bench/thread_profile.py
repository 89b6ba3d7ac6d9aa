"""Where a rank's threads spend a run: CPU time per thread and a sampled Python profile, no external profiler.

``ThreadProfile`` is started around a stretch of training steps. It reads

* each thread's CPU time from ``/proc/self/task/<tid>/schedstat`` (nanoseconds; else user + system ticks from
  ``stat``) at start and stop (Linux; other
  systems get the sampled profile only), for every thread of the process, Python's and native ones (Gloo's
  workers, CUDA's, the transfer engine's);
* every ``interval_s`` a sampler thread takes ``sys._current_frames()`` and counts, per Python thread, the
  function at the top of its stack.

Threads are put in three groups: the training thread (the main thread), bimetal's transport threads (Python
threads named ``bimetal-*``: cpu-forward's workers, the device-direct proxy) and the rest. What this can and
cannot say: a thread's CPU time includes time in C code that released the interpreter (a memcpy, a socket
write), so the CPU share of the transport threads is an upper bound on the time they hold the interpreter; the
sampled top-of-stack functions say where a thread sits (a ``wait`` is a thread blocked in C, a bimetal
function a thread running Python or about to call into C). The sampler holds the interpreter for a few
microseconds per sample (``overhead`` in the report counts them).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (kernel thread name, CPU seconds) of every thread of this process; empty where /proc is absent."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
            name = raw[raw.index("(") + 1:raw.rindex(")")]
            try:  # nanoseconds on the CPU (the scheduler's own count), where the kernel keeps it
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    cpu = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):  # else utime + stime, in clock ticks (fields 14, 15)
                fields = raw[raw.rindex(")") + 2:].split()
                cpu = (int(fields[11]) + int(fields[12])) / _TICK
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (name, cpu)
    return out


def _group(name: str, main: bool) -> str:
    if main:
        return "training"
    return "transport" if name.startswith("bimetal-") else "other"


class ThreadProfile:
    """Per-thread CPU time and sampled top-of-stack functions between ``start()`` and ``stop()``."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._samples: dict[int, Counter] = {}
        self._names: dict[int, str] = {}
        self._count = 0
        self._overhead = 0.0
        self._thread: threading.Thread | None = None
        self._cpu0: dict[int, tuple[str, float]] = {}
        self._t0 = 0.0

    def start(self) -> None:
        self._cpu0, self._t0 = _thread_cpu(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="profile-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            t = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                code = frame.f_code
                where = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                self._samples.setdefault(ident, Counter())[where] += 1
            self._count += 1
            self._overhead += time.perf_counter() - t

    def stop(self, steps: int = 1) -> dict[str, Any]:
        """The report: wall seconds, per thread CPU seconds and sampled functions, totals per group (also per step)."""
        wall = time.perf_counter() - self._t0
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        cpu1 = _thread_cpu()
        py = {t.native_id: t for t in threading.enumerate() if t.native_id is not None}
        main_id = threading.main_thread().native_id
        threads: list[dict[str, Any]] = []
        for tid, (name, cpu) in cpu1.items():
            used = cpu - self._cpu0.get(tid, (name, 0.0))[1]
            pt = py.get(tid)
            label = pt.name if pt is not None else name
            if pt is not None and pt.name == "profile-sampler":
                continue
            samples = self._samples.get(pt.ident, Counter()) if pt is not None and pt.ident is not None else Counter()
            total = sum(samples.values())
            threads.append({"thread": label, "group": _group(label, tid == main_id), "python": pt is not None,
                            "cpu_s": round(used, 4), "cpu_share": round(used / wall, 4) if wall > 0 else None,
                            "top": [[fn, round(n / total, 3)] for fn, n in samples.most_common(6)] if total else []})
        groups: dict[str, float] = {}
        for t in threads:
            groups[t["group"]] = groups.get(t["group"], 0.0) + t["cpu_s"]
        threads.sort(key=lambda t: -t["cpu_s"])
        return {"wall_s": round(wall, 4), "steps": steps, "samples": self._count,
                "overhead_s": round(self._overhead, 4), "proc_cpu": bool(cpu1),
                "cpu_s_per_step": {g: round(s / max(1, steps), 4) for g, s in sorted(groups.items())},
                "cpu_share": {g: round(s / wall, 4) if wall > 0 else None for g, s in sorted(groups.items())},
                "threads": [t for t in threads if t["cpu_s"] > 0 or t["python"]][:24]}
