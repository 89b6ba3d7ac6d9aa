"""The CPU stand-in for torchtitan's inner attention, defined once at module level (``cpu_support``).

FlexAttention has no backward on CPU; ``SdpaDocumentAttention`` computes the same causal, document-masked
attention (the varlen contract: ``cu_seqlens`` over packed documents) with ``scaled_dot_product_attention`` and
a dense mask. One class for every layer: ``torch.compile`` guards on a module's class, so a class made per
layer would recompile each block until the recompile limit stops the run.

Imports torchtitan: imported by ``cpu_support.sdpa_attention_config`` only after ``cpu_support.install`` has
imported torchtitan under its stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata


class SdpaDocumentAttention(VarlenAttention):
    """Causal attention within each packed document, on CPU, through SDPA (stand-in for flex/varlen)."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Any) -> None:
        torch.nn.Module.__init__(self)

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,  # noqa: N803
                attention_masks: VarlenMetadata, scale: float | None = None,
                out_transform: Any = None, **kwargs: Any) -> torch.Tensor:
        if out_transform is not None:
            raise NotImplementedError("the CPU attention stand-in does not return the log-sum-exp")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        B, L = q_BLNH.shape[0], q_BLNH.shape[1]  # noqa: N806
        starts = torch.zeros(B * L, dtype=torch.long)
        starts[attention_masks.cu_seq_q[:-1].long()] = 1
        doc = torch.cumsum(starts, 0).view(B, L)
        pos = torch.arange(L)
        mask = (doc[:, :, None] == doc[:, None, :]) & (pos[:, None] >= pos[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=bool(kwargs.get("enable_gqa", False)))
        return out.transpose(1, 2)
