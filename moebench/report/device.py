"""What a run ran on, in the one phrase a report repeats wherever it names the device: the Answer's
intro, the Runs section and every figure's caption.

A CPU run reads ``CPU: 2 threads per rank, gloo, bf16 matmul peak 110 GFLOP/s``: its speed depends on the
threads each rank had and on the calibration matmul its MFU divides by (and the dtype that matmul ran
in, the faster of bf16 and fp32: ``peak_flops_dtype``), so every number it gives comes with them. A GPU
run reads ``8 x NVIDIA H200, NCCL, bf16 dense peak 989 TFLOP/s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from moebench.record import METRICS, format_flop_rate
from moebench.results.table import is_missing, norm_value, run_tag


def machine_of(meta: dict[str, Any]) -> str:
    """A short description of the hardware a run used (GPU models, else ``CPU: model``: a CPU run
    says it is one wherever the caption or the Runs line names the machine)."""
    host = meta.get("host") or {}
    gpus = host.get("gpus") or []
    if gpus:
        names = sorted({str(g.get("name")) for g in gpus})
        return f"{len(gpus)} x {'/'.join(names)}"
    return f"CPU: {host.get('cpu_model') or 'unknown model'}"


def is_cpu(meta: dict[str, Any]) -> bool:
    return not (meta.get("host") or {}).get("gpus")


def _values(rows: pd.DataFrame, col: str) -> list[Any]:
    """The distinct values of ``col`` over the rows that recorded one, in order."""
    if col not in rows.columns:
        return []
    return sorted({v for v in rows[col] if not is_missing(v)}, key=str)


def _peak(rows: pd.DataFrame) -> str:
    """``110 GFLOP/s`` (or ``105 GFLOP/s to 110 GFLOP/s`` where the points' calibrations differ); empty: none."""
    peaks = sorted(float(v) for v in _values(rows, "peak_flops") if float(v) > 0)
    if not peaks:
        return ""
    low, high = format_flop_rate(peaks[0]), format_flop_rate(peaks[-1])
    return low if low == high else f"{low} to {high}"


def device_class(meta: dict[str, Any], t: pd.DataFrame) -> str:
    """The device phrase of one run (see the module docstring), from its meta and its rows of ``t``
    (the records' ``peak_flops``, ``peak_flops_dtype`` and ``cpu_threads``)."""
    rows = t[t["run_id"].map(norm_value) == norm_value(meta.get("run_id"))] if "run_id" in t.columns else t
    rows = rows[rows["status"] == "ok"] if "status" in rows.columns else rows
    peak = _peak(rows)
    if not is_cpu(meta):
        return ", ".join([machine_of(meta), "NCCL", *([f"bf16 dense peak {peak}"] if peak else [])])
    threads = "/".join(str(int(float(v))) for v in _values(rows, "cpu_threads"))
    parts = ["CPU: " + (f"{threads} thread{'' if threads == '1' else 's'} per rank" if threads else
                        "threads per rank not recorded"), "gloo"]
    if peak:
        # a record without peak_flops_dtype predates the bf16 calibration: its matmul ran in fp32
        dtypes = "/".join(norm_value(v) for v in _values(rows, "peak_flops_dtype")) or "fp32"
        parts.append(f"{dtypes} matmul peak {peak}")
    return ", ".join(parts)


def device_classes(metas: Sequence[dict[str, Any]], t: pd.DataFrame) -> str:
    """Each distinct device phrase of the loaded runs, ``; `` between them; where they differ, each after
    the suites that ran on it (``smoke on CPU: ...; expert-scaling on 8 x NVIDIA H200, ...``), or the runs
    where one suite has several (``c3d4@0d579b9 on CPU: ...``), as the point labels name them."""
    runs_of: dict[str, int] = {}
    for m in metas:
        runs_of[norm_value(m.get("suite"))] = runs_of.get(norm_value(m.get("suite")), 0) + 1
    named: dict[str, dict[str, None]] = {}  # phrase -> the suites (or runs, where a suite has several) on it
    for m in metas:
        suite = norm_value(m.get("suite"))
        name = " ".join([*([suite] if len(runs_of) > 1 else []), *([run_tag(m)] if runs_of[suite] > 1 else [])])
        named.setdefault(device_class(m, t), {})[name or suite] = None
    if len(named) == 1:
        return next(iter(named))
    return "; ".join(f"{', '.join(names)} on {phrase}" for phrase, names in named.items())


def mfu_header(t: pd.DataFrame, name: str = "mfu") -> str:
    """The header of an MFU column (``name``: ``mfu`` or ``useful_mfu``): ``MFU``, or with CPU points ``MFU (of
    bf16 matmul)``, so that a CPU's MFU is never read without the calibration matmul it divides by (the device
    phrase gives that peak)."""
    cpu = t[t["device"] == "cpu"] if "device" in t.columns else t.iloc[:0]
    if cpu.empty:
        return METRICS[name].header
    dtypes = "/".join(norm_value(v) for v in _values(cpu, "peak_flops_dtype")) or "fp32"
    gpu = (t["device"] == "cuda").any()  # a GPU point's MFU is of its datasheet peak
    return f"{METRICS[name].header} ({'CPU: ' if gpu else ''}of {dtypes} matmul)"
