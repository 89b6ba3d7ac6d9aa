"""A planner plan as a torchtitan run: ``bimetal plan SPEC --write-titan FILE``, read by ``bimetal titan --plan``.

The file is TOML: ``[torchtitan]`` holds torchtitan 0.3.0 overrides keyed by their ``--section.key`` names
(pp degree, FSDP shard degree and TP degree of every stage - torchtitan gives all stages the same ones, as
the planner's layouts do -, schedule, batch and sequence, and ``module_fqns_per_model_part`` from the
plan's layer split); ``[bimetal]`` holds the split itself, the pp transport and the module/config to run.
Pure Python: no torch, no torchtitan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

from bimetal.errors import UserError
from bimetal.outputs import write_text
from bimetal.plan.titan_split import module_fqns_per_model_part

# planner model flavour -> (torchtitan --module, --config)
TITAN_MODELS = {"llama3-8b": ("llama3", "llama3_8b"), "debug": ("llama3", "llama3_debugmodel")}


def runs_on_torchtitan(plan: Any, vendors: int) -> bool:
    """Whether torchtitan can run the plan on bimetal: a known model, and data/tensor groups inside a vendor."""
    return plan.model in TITAN_MODELS and (plan.pp > 1 or vendors == 1)


def plan_to_titan(plan: Any, n_layers: int) -> dict[str, Any]:
    """The ``--write-titan`` document for one plan (a ``bimetal.plan.search.Plan``)."""
    if plan.model not in TITAN_MODELS:
        raise UserError(f"torchtitan 0.3.0 has no model for the planner's {plan.model!r}; "
                        f"plan one of {', '.join(TITAN_MODELS)} for torchtitan")
    module, config = TITAN_MODELS[plan.model]
    overrides: dict[str, Any] = {
        "parallelism.pipeline_parallel_degree": plan.pp,
        "parallelism.data_parallel_shard_degree": plan.dp,
        "parallelism.data_parallel_replicate_degree": 1,
        "parallelism.tensor_parallel_degree": plan.tp,
        "parallelism.spmd_backend": "partial_dtensor",
        "training.seq_len": plan.seq,
        "training.local_batch_size": plan.micro_batch * plan.microbatches,
    }
    if plan.pp > 1:
        overrides |= {
            "parallelism.pipeline_parallel_schedule": "1F1B",
            "parallelism.pipeline_parallel_microbatch_size": plan.micro_batch,
            "training.disable_cuda_graphs": True,
            "parallelism.module_fqns_per_model_part": module_fqns_per_model_part(n_layers, list(plan.layer_split)),
        }
    return {
        "bimetal": {"module": module, "config": config, "model": plan.model, "pp_transport": plan.transport,
                    "layers_per_stage": list(plan.layer_split), "stage_groups": list(plan.stage_groups),
                    "predicted_tokens_per_s": round(plan.tokens_per_s, 1)},
        "torchtitan": overrides,
    }


def write_titan(path: str | Path, plan: Any, n_layers: int, spec_path: str) -> None:
    """Write the plan's torchtitan file, headed by the commands that run it."""
    doc = plan_to_titan(plan, n_layers)
    head = (
        f"# torchtitan run for {plan.model} on {spec_path}, written by `bimetal plan --write-titan`.\n"
        f"# Stages in order: {', '.join(plan.stage_groups)}; start those nodes with node ranks in this order.\n"
        f"# On every node: torchrun --nnodes=N --nproc-per-node=GPUS --node-rank=I --rdzv-endpoint=HOST:29500 \\\n"
        f"#   -m bimetal.integrations.torchtitan --plan {Path(path).name}\n"
    )
    write_text(path, head + tomli_w.dumps(doc))
