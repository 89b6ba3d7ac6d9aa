"""Step time of the pipeline schedule the trainer runs (torch.distributed.pipelining ``Schedule1F1B``).

A closed form, ``(m + p - 1) x slowest slot``, is exact only when every stage takes the same time. With
uneven stages (a capped rank, an uneven layer split) and slow links, this module replays the schedule's
own order of operations per stage and its blocking points instead:

* stage j runs ``min(m, p - j)`` warm-up forwards, then alternates backward / forward, then drains;
* the last warm-up forward's send is fused with the first backward's receive, and each backward's send
  with the next forward's receive, and the stage waits for the fused batch: a send blocks its sender
  until the bytes are out (a rate-limited link makes that the transfer time);
* the other warm-up sends and the cool-down sends are waited one operation later (they overlap compute).

A transfer that starts at time t arrives at t + its duration. Stages depend on each other's arrivals,
so the per-stage replay is iterated until no time changes (times only grow, and the dependency graph is
acyclic, so this reaches the exact event times in at most as many passes as there are operations).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageTimes:
    """Seconds per microbatch for one stage, and for sending across its boundary to the next stage."""

    fwd: float
    bwd: float
    send_next: float = 0.0
    """One activation (forward) or one activation gradient (backward) across the boundary to stage j+1."""


def one_f_one_b(stages: list[StageTimes], microbatches: int) -> tuple[float, list[float]]:
    """(makespan, per-stage end time) of one 1F1B schedule run starting at 0 on every stage."""
    p, m = len(stages), microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need at least one stage and one microbatch, got p={p}, m={m}")
    # arrive_f[j][k]: activation of microbatch k available at stage j; arrive_b[j][k]: its gradient.
    arrive_f = [[0.0] * m for _ in range(p)]
    arrive_b = [[0.0] * m for _ in range(p)]
    ends = [0.0] * p
    for _ in range(4 * p * m + 4):
        changed = False
        for j in range(p):
            new_f, new_b, end = _replay(j, stages, m, arrive_f, arrive_b)
            for k in range(m):
                if j + 1 < p and new_f[k] != arrive_f[j + 1][k]:
                    arrive_f[j + 1][k], changed = new_f[k], True
                if j > 0 and new_b[k] != arrive_b[j - 1][k]:
                    arrive_b[j - 1][k], changed = new_b[k], True
            ends[j] = end
        if not changed:
            return max(ends), ends
    raise RuntimeError("1F1B replay did not settle; this is a bug")  # pragma: no cover


def _replay(j: int, stages: list[StageTimes], m: int, arrive_f: list[list[float]],
            arrive_b: list[list[float]]) -> tuple[list[float], list[float], float]:
    """One stage's timeline given the current arrival estimates; returns the arrivals it causes."""
    p, st = len(stages), stages[j]
    first, last = j == 0, j == p - 1
    x_out = st.send_next  # forward activations leave to j+1
    x_in = stages[j - 1].send_next if not first else 0.0  # gradients leave to j-1 over the same link
    out_f, out_b = [0.0] * m, [0.0] * m
    t = 0.0
    send_done = 0.0  # completion of the send posted but not yet waited for

    def fire_f(k: int, at: float) -> float:
        done = at + (0.0 if last else x_out)
        out_f[k] = done
        return done

    def fire_b(k: int, at: float) -> float:
        done = at + (0.0 if first else x_in)
        out_b[k] = done
        return done

    warm = min(m, p - j)
    f_idx = b_idx = 0
    held_f: int | None = None
    for _ in range(warm):
        t = max(t, 0.0 if first else arrive_f[j][f_idx]) + st.fwd
        t = max(t, send_done)
        if f_idx != warm - 1:
            send_done = fire_f(f_idx, t)
        else:
            held_f = f_idx
        f_idx += 1
    held_b: int | None = None
    while True:
        wait = fire_f(held_f, t) if held_f is not None else t
        held_f = None
        t = max(wait, t if last else arrive_b[j][b_idx]) + st.bwd
        held_b, b_idx = b_idx, b_idx + 1
        if f_idx == m:
            break
        wait = fire_b(held_b, t)
        held_b = None
        t = max(wait, 0.0 if first else arrive_f[j][f_idx]) + st.fwd
        held_f, f_idx = f_idx, f_idx + 1
    send_done = fire_b(held_b, t) if held_b is not None else t
    while b_idx < m:
        t = max(t, arrive_b[j][b_idx]) + st.bwd
        t = max(t, send_done)
        send_done = fire_b(b_idx, t)
        b_idx += 1
    return out_f, out_b, max(t, send_done)


def one_f_one_b_on(stages: list[StageTimes], microbatches: int, shared_device: bool = True) -> float:
    """Makespan of one 1F1B run when every stage computes on the same device (``shared_device``): the device
    serves the stages' forwards and backwards one at a time, in the order they become ready (ties: the earlier
    stage), while transfers and the waits for them overlap the other stages' compute.

    The stage programs and their blocking points are ``_replay``'s. This is the case of ``bimetal bench
    gpu-ladder``: pipeline stages as processes sharing one GPU, where a stage waiting for its peer costs the
    step only when no stage has work. ``shared_device=False`` gives every stage its own device (then it equals
    ``one_f_one_b``'s makespan, which the tests check).
    """
    p, m = len(stages), microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need at least one stage and one microbatch, got p={p}, m={m}")
    arrivals: dict[tuple[str, int, int], float] = {}
    programs = [_program(j, stages, m, arrivals) for j in range(p)]
    pending: list[tuple | None] = [next(g) for g in programs]
    ends = [0.0] * p
    device_free = 0.0

    def advance(j: int, value: float) -> None:
        try:
            pending[j] = programs[j].send(value)
        except StopIteration as stop:
            pending[j], ends[j] = None, float(stop.value)

    while any(r is not None for r in pending):
        waiting = True
        while waiting:  # hand every stage the arrivals it waits for that are known by now
            waiting = False
            for j, req in enumerate(pending):
                if req is not None and req[0] == "need" and req[1] in arrivals:
                    advance(j, arrivals[req[1]])
                    waiting = True
        ready = [(req[1], j) for j, req in enumerate(pending) if req is not None and req[0] == "compute"]
        if not ready:
            if any(r is not None for r in pending):  # pragma: no cover
                raise RuntimeError("shared-device 1F1B replay is stuck; this is a bug")
            break
        at, j = min(ready)
        start = max(at, device_free) if shared_device else at
        end = start + pending[j][2]  # type: ignore[index]
        if shared_device:
            device_free = end
        advance(j, end)
    return max(ends)


def _program(j: int, stages: list[StageTimes], m: int, arrivals: dict[tuple[str, int, int], float]):
    """Stage ``j``'s 1F1B program as a generator: yields ``("need", key)`` for an arrival and ``("compute", ready,
    seconds)`` for device work (each answered with a time); writes the arrivals its sends cause; returns its end."""
    p, st = len(stages), stages[j]
    first, last = j == 0, j == p - 1
    x_out, x_in = st.send_next, stages[j - 1].send_next if not first else 0.0

    def fire_f(k: int, at: float) -> float:
        done = at + (0.0 if last else x_out)
        if not last:
            arrivals[("f", j + 1, k)] = done
        return done

    def fire_b(k: int, at: float) -> float:
        done = at + (0.0 if first else x_in)
        if not first:
            arrivals[("b", j - 1, k)] = done
        return done

    t, send_done = 0.0, 0.0
    warm = min(m, p - j)
    f_idx = b_idx = 0
    held_f: int | None = None
    for _ in range(warm):
        arrive = 0.0 if first else (yield ("need", ("f", j, f_idx)))
        t = yield ("compute", max(t, arrive), st.fwd)
        t = max(t, send_done)
        if f_idx != warm - 1:
            send_done = fire_f(f_idx, t)
        else:
            held_f = f_idx
        f_idx += 1
    held_b: int | None = None
    while True:
        wait = fire_f(held_f, t) if held_f is not None else t
        held_f = None
        arrive = t if last else (yield ("need", ("b", j, b_idx)))
        t = yield ("compute", max(wait, arrive), st.bwd)
        held_b, b_idx = b_idx, b_idx + 1
        if f_idx == m:
            break
        wait = fire_b(held_b, t)
        held_b = None
        arrive = 0.0 if first else (yield ("need", ("f", j, f_idx)))
        t = yield ("compute", max(wait, arrive), st.fwd)
        held_f, f_idx = f_idx, f_idx + 1
    send_done = fire_b(held_b, t) if held_b is not None else t
    while b_idx < m:
        arrive = yield ("need", ("b", j, b_idx))
        t = yield ("compute", max(t, arrive), st.bwd)
        t = max(t, send_done)
        send_done = fire_b(b_idx, t)
        b_idx += 1
    return max(t, send_done)
