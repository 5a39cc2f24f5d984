"""Shared helpers for the report and check tests: fixture paths, edited copies of stores, CLI runs."""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "results"


def fixture_store(suite: str) -> Path:
    """The one run folder of a checked-in fixture suite."""
    (run,) = [p for p in (FIXTURES / suite).iterdir() if (p / "meta.json").exists()]
    return run


Edited = dict[str, Any] | list[dict[str, Any]] | None


def edited_store(src: Path, dst: Path, edit: Callable[[dict[str, Any]], Edited] = lambda r: r,
                 meta_edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Copy a store, passing each record through ``edit`` (``None`` drops it, a list writes several records)
    and meta through ``meta_edit``."""
    shutil.copytree(src, dst)
    lines = (src / "records.jsonl").read_text().splitlines()
    out = [edit(json.loads(line)) for line in lines]
    out = [r for x in out for r in (x if isinstance(x, list) else [x])]
    (dst / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out if r is not None))
    if meta_edit is not None:
        meta = json.loads((src / "meta.json").read_text())
        meta_edit(meta)
        (dst / "meta.json").write_text(json.dumps(meta))
    return dst


def with_speed(record: dict[str, Any], factor: float, noise: float, seed: int, n: int = 20) -> dict[str, Any]:
    """Resample ``step_times_s`` around the record's median / ``factor`` with relative ``noise``.

    Every step-time-derived metric is recomputed the way the trainer computes it.
    """
    if record["status"] != "ok":
        return record
    rng = random.Random(seed)
    median = record["step_time_median_s"] / factor
    return with_steps(record, [median * (1 + rng.gauss(0, noise)) for _ in range(n)])


def with_steps(record: dict[str, Any], samples: list[float]) -> dict[str, Any]:
    """``record`` with ``samples`` as its step times, every step-time-derived metric recomputed as the trainer does."""
    step = statistics.median(samples)
    scale = record["step_time_median_s"] / step
    return {
        **record, "step_times_s": samples, "step_time_median_s": step, "timed_steps": len(samples),
        "tokens_per_s": record["tokens_per_step"] / step,
        "tokens_per_s_per_device": record["tokens_per_step"] / step / record["world_size"],
        "tflops_per_device": record["tflops_per_device"] * scale, "mfu": record["mfu"] * scale,
    }


def with_repeats(record: dict[str, Any], n: int, factor: float = 1.0, noise: float = 0.01, seed: int = 0,
                 steps: int = 20, phi: float = 0.0, run_offset: float = 0.0) -> list[dict[str, Any]]:
    """``n`` records of one point, as a sweep with ``repeats: n`` writes them (``repeat`` 0..n-1, ``repeats`` n,
    each its own run with its own key).

    Each repeat's steps are an AR(1) series (lag-1 correlation ``phi``, relative marginal
    ``noise``) around the record's median / ``factor``, times a log-normal run-level offset
    of relative size ``run_offset``. With ``phi`` and ``run_offset`` 0, a ``seed`` shared by
    two stores gives both the same noise pattern, so their medians differ exactly by their
    factors. A record that is not ok is repeated as it is.
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rec = record
        if record["status"] == "ok":
            median = record["step_time_median_s"] / factor * math.exp(rng.gauss(0, run_offset))
            x, samples = rng.gauss(0, 1), []
            for _ in range(steps):
                samples.append(median * (1 + noise * x))
                x = phi * x + math.sqrt(1 - phi ** 2) * rng.gauss(0, 1)
            rec = with_steps(record, samples)
        out.append({**rec, "repeat": i, "repeats": n, "key": f"{record['key']}-r{i}"})
    return out


def repeated_store(src: Path, dst: Path, n: int = 3, edit: Callable[[dict[str, Any]], Edited] = lambda r: r,
                   **kwargs: Any) -> Path:
    """Copy a store with every point run ``n`` times (:func:`with_repeats`), each record passed through ``edit``.

    Each point draws its own noise from ``seed`` and its point id, so two stores made with
    one seed share each point's pattern while the points of a store are independent.
    """
    seed = kwargs.pop("seed", 0)

    def expand(r: dict[str, Any]) -> Edited:
        edited = edit(r)
        own = seed * 1000003 + zlib.crc32(str(r.get("point_id")).encode())
        return None if edited is None else with_repeats(edited, n, seed=own, **kwargs)

    return edited_store(src, dst, expand)


def run_cli(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
            ) -> tuple[int, str, str]:
    """Run ``moebench ARGS`` through the real entry point in-process: (exit code, stdout, stderr)."""
    from moebench.cli import main

    monkeypatch.setattr(sys, "argv", ["moebench", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err
