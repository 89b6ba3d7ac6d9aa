"""Runs a subset of PyTorch's own distributed suite on one back-end and writes each test's outcome as JSON.

PyTorch's ``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`` holds the
point-to-point and collective tests torch runs on Gloo, NCCL and UCC (torch's ``test_distributed_spawn.py``
mixes it into ``TestDistBackend`` and starts the ranks with ``spawn``). This driver does the same with
``fork`` (about 20x cheaper per test here, and the children inherit bimetal's back-end registration). Several
back-ends run at once, each in a fork of this process made after the imports (torch's test modules cost about 4 s
of CPU to import: paid once, not once per back-end).

torch's module reads ``BACKEND`` from the environment at import time and decides many skips from the name
alone (``BACKEND != "gloo"``: "Only gloo backend supports timeouts", "GLOO Batch Send Recv CPU", ...). So the
module is imported with ``BACKEND=gloo`` whichever back-end is under test, and the back-end under test is then
put into the module's ``BACKEND``, which ``TestDistBackend._run`` passes to ``init_process_group`` for the
world group: a back-end under test is held to exactly the tests Gloo runs. ``test_world_backend`` (defined
here, run in the same ranks) checks that the world group really is the back-end under test.

Usage: ``WORLD_SIZE=3 python torch_conformance_run.py BACKEND[,BACKEND...] OUT_DIR TEST_NAME...``. Writes
``OUT_DIR/<BACKEND>.json`` per back-end: ``{test: {"outcome": "passed"|"failed"|"skipped", "detail": str,
"seconds": float}}``; exit status 0 when every back-end's run wrote its file.
Not collected by pytest (no ``test_`` prefix); ``test_torch_conformance.py`` drives it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import unittest

import torch
import torch.distributed as dist

import bimetal  # noqa: F401  (registers bimetal_cpu_forward before torch's module reads BACKEND)

torch.set_num_threads(1)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("TEMP_DIR", "/tmp")  # read at import; every test's setUp makes its own temporary folder
UNDER_TEST = "gloo"  # the back-end under test in this process (``run_backend`` sets it)
os.environ["BACKEND"] = "gloo"  # the name torch's import-time skips see (see the docstring)

import torch.testing._internal.distributed.distributed_test as torch_dist_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):
    """torch's distributed tests, one fresh set of forked ranks per test (``test_distributed_spawn``'s shape)."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    def test_world_backend(self) -> None:
        """The world group the tests run on is the back-end under test, not Gloo."""
        self.assertEqual(dist.get_backend(), UNDER_TEST)


class _Recorder(unittest.TestResult):
    """Keeps one outcome per test name, with the first lines of the failure text."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, object]] = {}
        self._t0 = 0.0

    @staticmethod
    def _name(test: unittest.TestCase) -> str:
        return test.id().rsplit(".", 1)[-1]

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802  (unittest's API)
        super().startTest(test)
        self._t0 = time.perf_counter()

    def _put(self, test: unittest.TestCase, outcome: str, detail: str) -> None:
        self.outcomes[self._name(test)] = {"outcome": outcome, "detail": detail[-20000:],
                                           "seconds": round(time.perf_counter() - self._t0, 2)}

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().addSuccess(test)
        self._put(test, "passed", "")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._put(test, "skipped", reason)

    def addFailure(self, test: unittest.TestCase, err) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err) -> None:  # noqa: N802
        super().addError(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))


def run_backend(backend: str, out: str, names: list[str]) -> None:
    """Run ``names`` with ``backend`` as the world group's back-end; the outcomes in ``out``."""
    global UNDER_TEST
    UNDER_TEST = backend
    torch_dist_test.BACKEND = backend  # the world group's back-end (TestDistBackend._run reads it)
    suite = unittest.TestSuite(TestDistBackendWithFork(name) for name in names)
    result = _Recorder()
    suite.run(result)
    with open(out, "w") as f:
        json.dump(result.outcomes, f, indent=1, sort_keys=True)


def main() -> int:
    backends, out_dir, names = sys.argv[1].split(","), sys.argv[2], sys.argv[3:]
    # what the imports made goes to the collector's permanent generation: the forks' collections (every test's
    # ranks are forks too) walk only their own objects, and touch no page of torch's modules to do it
    gc.freeze()
    children = []
    for backend in backends[1:]:  # each in a fork of this process, which has imported everything once
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run_backend(backend, os.path.join(out_dir, f"{backend}.json"), names)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    run_backend(backends[0], os.path.join(out_dir, f"{backends[0]}.json"), names)
    return max([0, *(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children)])


if __name__ == "__main__":
    sys.exit(main())
