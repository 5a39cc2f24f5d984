"""What a run's operands were: statistics of the weights a rank holds, by group.

The same GEMM shape can run at different speeds on different operands: on B300 a grouped GEMM ran
16-39% faster on constant or zero operands than on normal ones (OLMo-core 3's campaign notes). Two runs
of one config compare only if their operands were alike, so every record says what its rank 0 held after
the run (``operand_stats``), and ``moebench check`` names a difference as the environment's, not the code's
(:func:`moebench.report.gate.check.environment_warnings`).

Groups: ``experts`` (routed and shared expert weights), ``router``, ``attention``, ``embeddings`` (token
embedding and LM head), ``norms``. Per group: ``rms`` (root mean square), ``abs_max`` and
``zero_fraction`` (exact zeros) over every element this rank holds (its shards under FSDP).
"""

from __future__ import annotations

import torch
from torch import nn

# A name part -> its group, first match wins; norms (a module whose name has "norm") go first
_GROUPS = (("experts", "experts"), ("shared", "experts"), ("router", "router"), ("attn", "attention"),
           ("tok_emb", "embeddings"), ("lm_head", "embeddings"))
STATS = ("rms", "abs_max", "zero_fraction")


def group_of(name: str) -> str:
    """The operand group of parameter ``name`` (``layers.3.ffn.experts.w13`` -> ``experts``)."""
    parts = name.split(".")
    owner = parts[-2] if len(parts) > 1 else parts[0]  # the module holding the parameter
    if "norm" in owner:
        return "norms"
    for part, group in _GROUPS:
        if part in parts:
            return group
    return "other"


@torch.no_grad()
def operand_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """``{group: {rms, abs_max, zero_fraction}}`` over the parameters this rank holds (one host sync)."""
    sums: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        t = param.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP shard: this rank's part
        if t.numel() == 0:
            continue
        t = t.float()
        group = group_of(name)
        parts = [t.square().sum(), t.abs().max(), (t == 0).sum().float()]
        if group in sums:
            old = sums[group]
            parts = [old[0] + parts[0], torch.maximum(old[1], parts[1]), old[2] + parts[2]]
        sums[group] = parts
        counts[group] = counts.get(group, 0) + t.numel()
    if not sums:
        return {}
    values = torch.stack([torch.stack(v) for v in sums.values()]).tolist()
    return {group: {"rms": (sq / counts[group]) ** 0.5, "abs_max": mx, "zero_fraction": zeros / counts[group]}
            for group, (sq, mx, zeros) in zip(sums, values, strict=True)}
