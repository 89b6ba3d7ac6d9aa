"""``bimetal titan`` as a torchtitan user meets it: per-hop pipelines, rank-prefixed and filtered output, the loss on
every step line, real memory figures, sentences that name ``bimetal titan``, and ``--compile.enable`` on CPU.

Two launched jobs, each checking several things (and the first one's all-Gloo reference):

* pp=4, ``Interleaved1F1B`` (two stages per rank, the last virtual stage wrapping back to rank 0) over
  ``nvidia:2,amd:2``, shown ranks 0 and 3: losses identical to the all-Gloo run of the same arguments (run in the
  same test, on the same machine: float sums depend on its math libraries), the group table with native hops 0-1
  and 2-3 and cpu-forward hops 1-2 and 3-0, only ranks 0 and 3 in the output and every line of theirs prefixed,
  the last stage's loss on rank 0's step line, torchtitan's note on its defaults once per shown rank (not twice,
  not from the launcher), the memory column a real figure, and the crossing hops' byte counters agreeing end to end
  (native hops keep none);
* FSDP over ``nvidia:2`` with ``--compile.enable`` (the ``aot_eager`` backend: Dynamo's guards, where a class
  made per layer hit the recompile limit in step 2, without Inductor's C++ build) and rank 1 killed after step 2
  (``BIMETAL_FAULT_KILL``): both steps run compiled, the launcher's sentence names ``bimetal titan``, rank 1's
  hidden output stays hidden but for its stderr tail shown with the failure.

The three jobs run one after another as ``python -m bimetal.integrations.torchtitan --simulate ...`` (the ``bimetal
titan`` command's own ``main``: it checks the mesh, writes the assets and launches the ranks, forked from itself),
forked from one interpreter that imported torch and torchtitan once (``tests/forked_runs.py``), not a new launcher
importing them per job (~6 s of CPU each).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from launcher import clean_env

from bimetal.integrations.torchtitan import available

pytestmark = [pytest.mark.skipif(not available(), reason="torchtitan is not installed: pip install "
                                                          "'bimetal[torchtitan]'"), pytest.mark.timeout(300)]
COMMON = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len=32",
          "--training.local_batch_size=4", "--validator.no-enable", "--parallelism.spmd_backend=partial_dtensor",
          "--debug.seed=7", "--training.steps=2", "--checkpoint.no-enable"]
PP4 = ["titan", "--simulate", "nvidia:2,amd:2", *COMMON, "--parallelism.pipeline_parallel_degree=4",
       "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"]
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+\S+\s+memory:\s+(\S+)GiB")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ROOT = Path(__file__).resolve().parents[1]


def _lines(text: str) -> list[str]:
    return [ANSI.sub("", line) for line in text.splitlines() if line.strip()]


def _steps(lines: list[str], rank: int) -> dict[int, tuple[str, float]]:
    """step -> (loss as printed, memory GiB) from ``rank``'s step lines."""
    out = {}
    for line in lines:
        m = STEP.search(line)
        if line.startswith(f"[rank{rank}]:") and m:
            out[int(m.group(1))] = (m.group(2), float(m.group(3)))
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The three jobs, one after another (see the module docstring): (their folder, name -> result)."""
    from forked_runs import runs

    tmp = tmp_path_factory.mktemp("titan")
    todo = {"gloo": ([*PP4, "--all-gloo", f"--dump_folder={tmp / 'gloo'}"], clean_env()),
            "mixed": ([*PP4, "--local-ranks-filter", "0,3", f"--dump_folder={tmp / 'mixed'}"], clean_env()),
            "compile": (["titan", "--simulate", "nvidia:2", *COMMON, "--compile.enable", "--compile.backend=aot_eager",
                         f"--dump_folder={tmp / 'compile'}"], clean_env(BIMETAL_FAULT_KILL="1:2"))}
    done = runs([(["-m", "bimetal.integrations.torchtitan", *argv[1:]], ROOT) for argv, _ in todo.values()],
                env=clean_env(), envs=[env for _, env in todo.values()], at_once=False, timeout=540)
    return tmp, dict(zip(todo, done))


@pytest.mark.timeout(600)
def test_pp4_interleaved_per_hop_prefixed_filtered_and_like_all_gloo(jobs) -> None:
    tmp_path, done = jobs
    gloo = done["gloo"]
    assert gloo.returncode == 0, gloo.stderr[-3000:]
    ref = [e["loss"] for e in json.loads((tmp_path / "gloo" / "bimetal" / "rank3.json").read_text())["losses"]]
    proc = done["mixed"]
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    out, err = _lines(proc.stdout), _lines(proc.stderr)
    ranked = [line for line in out + err if line.startswith("[rank")]
    assert ranked and all(line.startswith(("[rank0]:", "[rank3]:")) for line in ranked), \
        [line for line in ranked if not line.startswith(("[rank0]:", "[rank3]:"))][:5]
    assert any(line.startswith("[rank3]:") for line in out)
    table = {line.split()[0][len("[rank0]:"):]: line.split()[1:] for line in out
             if line.startswith("[rank0]:pp")}
    assert table["pp"] == ["0,1,2,3", "nvidia,amd", "cross-vendor", "bimetal_per_hop"]
    assert table["pp.hop0-1"] == ["0,1", "nvidia", "homogeneous-nvidia", "bimetal_sim_native"]
    assert table["pp.hop1-2"] == ["1,2", "nvidia,amd", "cross-vendor", "bimetal_cpu_forward"]
    assert table["pp.hop2-3"] == ["2,3", "amd", "homogeneous-amd", "bimetal_sim_native"]
    assert table["pp.hop3-0"] == ["3,0", "amd,nvidia", "cross-vendor", "bimetal_cpu_forward"]  # the wrap-around
    reports = {r: json.loads((tmp_path / "mixed" / "bimetal" / f"rank{r}.json").read_text()) for r in range(4)}
    losses = [e["loss"] for e in reports[3]["losses"]]
    assert len(losses) == 2 and losses == ref, (losses, ref)
    # rank 0 holds the first stage: its step line shows the last stage's loss, as rank 3's does
    first, last = _steps(out, 0), _steps(out, 3)
    assert sorted(first) == sorted(last) == [1, 2]
    assert [first[s][0] for s in (1, 2)] == [last[s][0] for s in (1, 2)] == [f"{x:.5f}" for x in losses]
    assert all(0.05 < mem < 64 for _, mem in [*first.values(), *last.values()])  # the rank's peak RSS, not -0.00
    assert not any("loss is not visible" in line for line in out + err)
    # torchtitan's note about its own default: once per shown rank, in its format, never unprefixed from the launcher
    notes = [line for line in out + err if "initial_load_model_only=True has no effect" in line]
    assert sorted(line[:len("[rank0]:")] for line in notes) == ["[rank0]:", "[rank3]:"], notes
    # Bytes: a native hop has no bimetal counters; each crossing hop's two ends agree (sent = received).
    hops = {r: reports[r]["groups"]["pp"]["hops"] for r in range(4)}
    for r, mine in hops.items():
        for name, hop in mine.items():
            assert (hop["counters"] is None) == (hop["backend"] == "bimetal_sim_native"), (r, name, hop)
    for name, (a, b) in (("pp.hop1-2", (1, 2)), ("pp.hop3-0", (3, 0))):
        ca, cb = hops[a][name]["counters"], hops[b][name]["counters"]
        assert ca["bytes_sent"] == cb["bytes_received"] > 0 and cb["bytes_sent"] == ca["bytes_received"] > 0


@pytest.mark.timeout(600)
def test_compile_with_fsdp_runs_and_a_crash_names_bimetal_titan(jobs) -> None:
    proc = jobs[1]["compile"]
    out, err = _lines(proc.stdout), _lines(proc.stderr)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
    # the launcher's sentences (rank 0, done with its steps, may yet be stopped by it if its exit is slow)
    said = [line for line in err if not line.startswith("[rank")]
    assert "bimetal titan: rank 1 (nvidia) was killed by SIGKILL after completing step 2; the job stopped." in said
    assert all(line.startswith("bimetal titan: ") for line in said[said.index(
        "bimetal titan: rank 1 (nvidia) was killed by SIGKILL after completing step 2; the job stopped."):]), said
    assert sorted(_steps(out, 0)) == [1, 2]  # compiled both steps (a class per layer stopped step 2)
    assert not any("recompile" in line for line in out + err)
    assert not any(line.startswith("[rank1]:") for line in out)  # the default filter shows rank 0 only
    hidden = [i for i, line in enumerate(err) if line.startswith("[rank1]:")]
    assert hidden and "hidden by the filter" in err[hidden[0]], err[hidden[0]] if hidden else err[-5:]
