"""Shared helpers for the report and check tests: fixture paths, edited copies of stores, CLI runs."""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "results"


def fixture_store(suite: str) -> Path:
    """The one run folder of a checked-in fixture suite."""
    (run,) = [p for p in (FIXTURES / suite).iterdir() if (p / "meta.json").exists()]
    return run


def edited_store(src: Path, dst: Path, edit: Callable[[dict[str, Any]], dict[str, Any] | None] = lambda r: r,
                 meta_edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Copy a store, passing each record through ``edit`` (``None`` drops it) and meta through ``meta_edit``."""
    shutil.copytree(src, dst)
    lines = (src / "records.jsonl").read_text().splitlines()
    out = [edit(json.loads(line)) for line in lines]
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
    samples = [median * (1 + rng.gauss(0, noise)) for _ in range(n)]
    step = statistics.median(samples)
    scale = record["step_time_median_s"] / step
    return {
        **record, "step_times_s": samples, "step_time_median_s": step, "timed_steps": n,
        "tokens_per_s": record["tokens_per_step"] / step,
        "tokens_per_s_per_device": record["tokens_per_step"] / step / record["world_size"],
        "tflops_per_device": record["tflops_per_device"] * scale, "mfu": record["mfu"] * scale,
    }


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
