"""``moebench plan --validate``: plan every published operating point that has a preset, at its
published hardware, layout and batch, and set the plan beside the published value.

The planner is not fitted here (:mod:`moebench.plan.published_fit` fits its matmul efficiency on
the rows the data files declare ``calibration``, and the command plans with it): a calibration row
is shown as such, the others as held out, each with plan / published. What a row does not state is planned with
moebench's default and said so in the row's notes; a row moebench cannot express is listed with why.
Each row is planned with the settings its source states mirror its framework's implementation
(``implementation`` in the data file), listed first in its notes ("planned as: ...").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moebench.devices import get_device
from moebench.errors import ConfigError
from moebench.plan.planner import PlanOptions, apply_world_size, build_plan
from moebench.plan.published import GIB, NOT_STATED, PublishedRow
from moebench.presets import load_config

# published routing -> moe.routing (force-balanced: Megatron's and torchtitan's forced balance)
_ROUTING = {"learned": "learned", "random": "random", "uniform": "uniform", "force-balanced": "uniform"}


class NotPlanned(ValueError):
    """A published row moebench's planner cannot express; the message says why."""


@dataclass(frozen=True)
class Setting:
    overrides: list[str]
    notes: list[str]


def row_setting(row: PublishedRow) -> Setting:
    """The preset overrides that lay ``row`` out as published, and what had to be assumed."""
    lay, batch = row.layout, row.batch
    if row.preset is None:
        raise NotPlanned(f"no preset of the {row.model_name} shape")
    if lay.two_batch_overlap:
        raise NotPlanned("two-batch overlap is not modelled")
    if lay.tp > 1 or lay.cp > 1:
        raise NotPlanned(f"tensor/context parallelism (tp={lay.tp}, cp={lay.cp}) is not modelled")
    unstated = [f"batch.{k}" for k in ("seq_len", "micro_batch_sequences", "global_batch_sequences")
                if getattr(batch, k) == NOT_STATED]
    if unstated:
        raise NotPlanned(f"{', '.join(unstated)} not stated")
    dp = row.gpus // lay.pp
    chunks, rest = divmod(batch.global_batch_sequences, batch.micro_batch_sequences * dp)
    if rest or chunks < 1:
        raise NotPlanned(f"global batch {batch.global_batch_sequences} is not whole micro-batches of "
                         f"{batch.micro_batch_sequences} on dp={dp}")
    notes: list[str] = []
    sets = {"model.seq_len": batch.seq_len, "train.global_batch_size": batch.global_batch_sequences,
            "parallel.ep": lay.ep, "parallel.pp": lay.pp,
            "parallel.strategy": "fsdp" if lay.data_parallel == "fsdp" else "ddp",
            "parallel.dispatcher": "rowwise" if lay.ep_transport == "row-wise" else "sync"}
    if lay.data_parallel == NOT_STATED:
        notes.append("data parallelism not stated: ddp")
    if lay.ep > 1 and lay.ep_transport != "row-wise":
        notes.append(f"EP transport {lay.ep_transport}: planned as the sync all-to-all")
    if lay.dist_opt == NOT_STATED:
        notes.append("dist_opt not stated: off")
    sets["parallel.dist_opt"] = str(lay.dist_opt is True).lower()
    if lay.pp > 1:
        # one pipeline flush a step: every micro-batch of the step is a chunk of it
        sets["train.micro_batch_size"] = batch.micro_batch_sequences * chunks
        sets["parallel.pp_microbatches"] = chunks
        vs = lay.virtual_stages
        sets["parallel.pp_schedule"] = "1f1b" if vs in (1, NOT_STATED) else "interleaved-1f1b"
        if vs == NOT_STATED:
            notes.append("virtual stages not stated: 1f1b")
        elif vs > 1:
            sets["parallel.pp_virtual_stages"] = vs
        if lay.stage_layers != NOT_STATED:
            sets["parallel.pp_layers"] = ",".join(map(str, lay.stage_layers))
    else:
        sets["train.micro_batch_size"] = batch.micro_batch_sequences
    if row.routing != NOT_STATED and load_config(row.preset).moe.expert_groups > 1 and row.routing != "learned":
        # the planner assumes balanced routes whatever the mode; group-limited routing is learned only
        notes.append(f"{row.routing} routing planned as the preset's group-limited learned routing")
    elif row.routing != NOT_STATED:
        sets["moe.routing"] = _ROUTING[row.routing]
    if isinstance(row.capacity_factor, float):
        sets["moe.capacity_factor"] = row.capacity_factor
    if row.precision != NOT_STATED:
        sets["precision.mode"] = row.precision
    if row.precision_scope != NOT_STATED:
        sets["precision.scope"] = row.precision_scope
    if row.recompute != NOT_STATED:
        sets["parallel.activation_checkpointing"] = row.recompute
    else:
        notes.append("recompute not stated: none")
    sets |= row.implementation
    return Setting([f"{k}={_text(v)}" for k, v in sets.items()], [implementation_note(row), *notes])


def _text(value: Any) -> str:
    return "none" if value is None else str(value)


def implementation_note(row: PublishedRow) -> str:
    """What the row is planned with to mirror its framework's implementation."""
    if not row.implementation:
        return "planned as: moebench's defaults (the source states no implementation setting)"
    return "planned as: " + ", ".join(f"{k}={_text(v)}" for k, v in row.implementation.items())


def planned_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A plan's figures under the published metrics' names."""
    return {"tokens_per_s_per_device": record["tokens_per_s_per_device"],
            "tflops_per_device": record["tflops_per_device"],
            "peak_mem_gib": record["peak_mem_bytes"] / GIB}


def plan_row(row: PublishedRow, options: PlanOptions) -> dict[str, Any]:
    """The plan of one row: its record, or why there is none (``not_planned``)."""
    # plans at the datasheet hardware the rows ran on: the torch installed here is not asked
    options = dataclasses.replace(options, kernel_gap=None)
    try:
        setting = row_setting(row)
        cfg = load_config(row.preset).apply_overrides(setting.overrides)
        laid = apply_world_size(cfg, row.gpus, dp_given=False, batch_given=True)
        record = build_plan(laid, get_device(row.gpu), options)
    except (NotPlanned, ConfigError) as exc:
        return {"not_planned": str(exc)}
    return {"record": record, "overrides": setting.overrides, "notes": setting.notes}


def validate(rows: list[PublishedRow], options: PlanOptions | None = None) -> list[dict[str, Any]]:
    """One line per (row, published value): published, planned and plan / published.

    Relative values are planned relative too: ``tokens_per_s_ratio`` is this row's planned tokens/s
    over its ``relative_to`` row's, ``peak_mem_delta_gib`` the difference of their planned peaks.
    Metrics the planner has no figure for (persistent / transient split, EP buffer) get none.
    """
    options = options or PlanOptions()
    plans = {row.id: plan_row(row, options) for row in rows if row.preset is not None}
    planned = {i: planned_metrics(p["record"]) for i, p in plans.items() if "record" in p}
    lines = []
    for row in rows:
        plan = plans.get(row.id, {"not_planned": f"no preset of the {row.model_name} shape"})
        for m in row.measured:
            value = None
            if row.id in planned:
                mine = planned[row.id]
                if m.metric in mine:
                    value = mine[m.metric]
                elif m.relative_to in planned:
                    other = planned[m.relative_to]
                    value = (mine["tokens_per_s_per_device"] / other["tokens_per_s_per_device"]
                             if m.metric == "tokens_per_s_ratio" else mine["peak_mem_gib"] - other["peak_mem_gib"])
            record = plan.get("record")
            lines.append({
                "row": row.id, "role": row.role, "preset": row.preset, "gpu": row.gpu, "gpus": row.gpus,
                "metric": m.metric, "unit": m.unit, "published": m.value, "approximate": m.approximate,
                "relative_to": m.relative_to, "planned": value,
                "ratio": None if value is None or m.value == 0 else value / m.value,
                "fits": None if record is None else record["plan"]["fits"],
                "not_planned": plan.get("not_planned"), "notes": plan.get("notes", []),
                "overrides": plan.get("overrides"),  # the --set items that plan the row with `moebench plan`
            })
    return lines


def _number(value: float, unit: str) -> str:
    if unit in ("x",):
        return f"{value:.3f}"
    if unit == "GiB":
        return f"{value:,.2f}"
    return f"{value:,.0f}"


def validate_lines(lines: list[dict[str, Any]]) -> list[str]:
    """The --validate table as text, one published value a line, then each row's notes."""
    out = ["| row | role | metric | published | planned | plan / published | |",
           "|---|---|---|---|---|---|---|"]
    for line in lines:
        published = ("~" if line["approximate"] else "") + _number(line["published"], line["unit"])
        if line["relative_to"]:
            published += f" vs {line['relative_to']}"
        planned = "-" if line["planned"] is None else _number(line["planned"], line["unit"])
        ratio = "-" if line["ratio"] is None else f"{line['ratio']:.2f}"
        why = line["not_planned"] or ("" if line["fits"] in (True, None) else "does not fit")
        out.append(f"| {line['row']} | {line['role']} | {line['metric']} ({line['unit']}) | {published} | "
                   f"{planned} | {ratio} | {why} |")
    notes = {}
    for line in lines:
        if line["notes"]:
            notes.setdefault(line["row"], line["notes"])
    if notes:
        out.append("")
        out += [f"- {row}: {'; '.join(n)}" for row, n in notes.items()]
    return out
