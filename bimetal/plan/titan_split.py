"""bimetal's uneven layer split (one count per pipeline rank) as torchtitan's ``module_fqns_per_model_part``.

A pipeline rank holds one model part under a single-stage schedule (1F1B, GPipe) and ``stages_per_rank``
parts under a multi-stage one (Interleaved1F1B, ...). torchtitan places part ``k`` on rank ``k % pp``
("loop" style) or, for V schedules, parts ``r`` and ``2*pp-1-r`` on rank ``r``. Each rank's layer count is
shared among its parts (earlier parts take the remainder), and parts take consecutive layers in part order;
the first part also holds the embeddings, the last the final norm and the output head.
"""

from __future__ import annotations

from bimetal.errors import UserError

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def part_ranks(pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Pipeline rank of each model part, in part order."""
    parts = pp * stages_per_rank
    if schedule in V_SCHEDULES:
        if stages_per_rank != 2:
            raise UserError(f"schedule {schedule} puts exactly 2 stages on each rank, not {stages_per_rank}")
        return [k if k < pp else parts - 1 - k for k in range(parts)]
    return [k % pp for k in range(parts)]


def module_fqns_per_model_part(n_layers: int, layers_per_rank: list[int], stages_per_rank: int = 1,
                               schedule: str = "1F1B") -> list[list[str]]:
    """torchtitan's ``parallelism.module_fqns_per_model_part`` for ``layers_per_rank`` (one entry per pp rank)."""
    pp = len(layers_per_rank)
    if sum(layers_per_rank) != n_layers:
        raise UserError(f"layers per stage {layers_per_rank} sum to {sum(layers_per_rank)} but the model has "
                        f"{n_layers} layers; make them sum to {n_layers}")
    if min(layers_per_rank) < stages_per_rank:
        raise UserError(f"layers per stage {layers_per_rank}: every pipeline rank needs at least "
                        f"{stages_per_rank} layers, one per stage it holds")
    owners = part_ranks(pp, stages_per_rank, schedule)
    shares: dict[int, list[int]] = {}
    for r, total in enumerate(layers_per_rank):
        base, extra = divmod(total, stages_per_rank)
        shares[r] = [base + (1 if j < extra else 0) for j in range(stages_per_rank)]
    taken = {r: 0 for r in range(pp)}
    parts, layer = [], 0
    for k, r in enumerate(owners):
        count = shares[r][taken[r]]
        taken[r] += 1
        names = ["tok_embeddings"] if k == 0 else []
        names += [f"layers.{i}" for i in range(layer, layer + count)]
        layer += count
        if k == len(owners) - 1:
            names += ["norm", "lm_head"]
        parts.append(names)
    return parts


def parse_split(text: str) -> list[int]:
    """``"4,2"`` -> ``[4, 2]``; ``UserError`` on anything else."""
    try:
        split = [int(x) for x in text.replace("[", "").replace("]", "").split(",") if x.strip()]
    except ValueError:
        split = []
    if not split or min(split) < 1:
        raise UserError(f"--layers-per-stage {text!r} is not a list of positive layer counts, e.g. 4,2")
    return split
