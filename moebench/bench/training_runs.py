"""The GPU check's training section: a ``small`` run compiled vs eager, in bf16 and in fp8.

Each run is ``moebench train ... --json`` in its own process (so every compiled run compiles
from a fresh process, as a user's would, and a crash or a timeout costs only its row). The
section reports each run's tokens/s, MFU, compile time, which expert backend and quantized
GEMMs ran, and the final loss, then the ratios that matter: compiled / eager tokens/s per
precision, fp8 / bf16 tokens/s per mode, and how far the compiled run's final loss is from the
eager one's (same data, same seed: only rounding differs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

# (precision.mode, train.compile) of every run, in order: the bf16 pair first, so a short budget
# still yields the compiled-vs-eager ratio
RUNS = [("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True)]
_KEPT = ("tokens_per_s", "mfu", "step_time_median_s", "compile_s", "compiled", "moe_backend", "precision",
         "precision_impl", "precision_probe_error", "loss_first", "loss_last", "timed_steps")
# the learning check: a run on learnable data must lower its loss by this share of the first step's;
# its lr=0 negative control must not (tests/test_kernels_gpu.py shows both verdicts)
LEARN_MIN_DROP = 0.05


def run_name(precision: str, compiled: bool) -> str:
    return f"{precision}_{'compiled' if compiled else 'eager'}"


def train_once(preset: str, device: str, precision: str, compiled: bool, steps: int,
               timeout_s: float, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``moebench train`` run in a subprocess: the record's main fields, or its error
    (``extra``: more ``section.field=value`` settings)."""
    cmd = [sys.executable, "-m", "moebench.cli", "train", "--preset", preset, "--steps", str(steps),
           "--set", f"train.device={device}", "--set", f"precision.mode={precision}",
           "--set", f"train.compile={str(compiled).lower()}", "--set", "train.profile_steps=0", "--json"]
    cmd += [a for item in extra for a in ("--set", item)]
    record, error = train_record(cmd, timeout_s)
    return {"error": error} if record is None else {key: record.get(key) for key in _KEPT}


def train_record(cmd: list[str], timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """Run a ``moebench train ... --json`` command line: ``(its ok record, None)`` or ``(None, why not)``."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return None, f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"
    record = json.loads(lines[-1])
    if record.get("status") != "ok":
        return None, f"status {record.get('status')}: {record.get('error')}"
    return record, None


def section_training(ctx: dict[str, Any]) -> dict[str, Any]:
    """Every run of :data:`RUNS` on the check's device (``small``; ``tiny`` with ``--small``)."""
    preset, steps = ("tiny", 3) if ctx["small"] else ("small", 12)
    out: dict[str, Any] = {"preset": preset, "steps": steps}
    for precision, compiled in RUNS:
        name = run_name(precision, compiled)
        left = ctx["deadline"] - time.monotonic()
        if left < 30:
            out[name] = {"skipped": "time budget"}
            continue
        out[name] = train_once(preset, ctx["device"].type, precision, compiled, steps, min(left, 240.0))
    out.update(training_ratios(out))
    return out


def learned(run: dict[str, Any]) -> bool | None:
    """Whether a finished run lowered its loss by :data:`LEARN_MIN_DROP` of its first step's (None: unfinished)."""
    if run.get("loss_first") is None or run.get("loss_last") is None:
        return None
    return (run["loss_first"] - run["loss_last"]) / abs(run["loss_first"]) >= LEARN_MIN_DROP


def section_learning(ctx: dict[str, Any]) -> dict[str, Any]:
    """Does training train? ``train.data=markov`` (learnable), eager, at the default lr and at lr=0:
    the first must pass :func:`learned`, the second, the negative control, must fail it."""
    preset, steps = ("tiny", 12) if ctx["small"] else ("small", 30)
    out: dict[str, Any] = {"preset": preset, "steps": steps, "min_drop": LEARN_MIN_DROP}
    for name, extra in (("default_lr", ()), ("control_lr0", ("train.lr=0",))):
        left = ctx["deadline"] - time.monotonic()
        if left < 20:
            out[name] = {"skipped": "time budget"}
            continue
        run = train_once(preset, ctx["device"].type, "auto", False, steps, left,
                         ("train.data=markov", "train.warmup_steps=1", *extra))
        run["learned"] = learned(run)
        out[name] = run
    out["ok"] = out["default_lr"].get("learned") is True and out["control_lr0"].get("learned") is False
    return out


def training_ratios(runs: dict[str, Any]) -> dict[str, float]:
    """compiled / eager and fp8 / bf16 tokens/s, and the compiled run's relative final-loss change,
    for every pair whose two runs finished."""

    def rate(name: str) -> float | None:
        return (runs.get(name) or {}).get("tokens_per_s")

    out: dict[str, float] = {}
    for precision in ("bf16", "fp8"):
        eager, compiled = run_name(precision, False), run_name(precision, True)
        if rate(eager) and rate(compiled):
            out[f"{precision}_compiled_vs_eager"] = rate(compiled) / rate(eager)
            loss_e, loss_c = runs[eager]["loss_last"], runs[compiled]["loss_last"]
            out[f"{precision}_compiled_loss_rel_diff"] = abs(loss_c - loss_e) / abs(loss_e)
    for compiled in (False, True):
        bf16, fp8 = run_name("bf16", compiled), run_name("fp8", compiled)
        if rate(bf16) and rate(fp8):
            out[f"fp8_vs_bf16_{'compiled' if compiled else 'eager'}"] = rate(fp8) / rate(bf16)
    return out
