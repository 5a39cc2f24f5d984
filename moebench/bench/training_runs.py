"""The GPU check's sections that run ``moebench train``, each run ``moebench train ... --json``
in its own process (so every compiled run compiles from a fresh process, as a user's would, and
a crash or a timeout costs only its row).

- ``learning``: does training train? ``train.data=markov`` (learnable) at the default lr must end
  at least :data:`LEARN_MIN_DROP` below the same run at lr=0, and that lr=0 negative control must
  fail the check against its own first step (a trainer that ignores the lr, or data whose loss
  falls by itself, FAILs).
- ``scope_linear``: fp8 with ``precision.scope=linear`` (attention, dense FFN and shared expert
  linears quantized too) trains on the same data.
- ``phase_clock``: the step clock of the timed steps (CUDA events at every phase mark, forward
  and backward, read after the window): the phases must partition the step, and the step they
  partition must be the timed one.
- ``triton_training``: ``moe.backend=triton`` through the trainer (the MoE block's own
  dispatcher, the Triton expert GEMMs) trains, and the record says triton ran.
- ``training``: a ``small`` run compiled vs eager, in bf16 and in fp8, on markov data: tokens/s,
  MFU, compile time, which expert backend and quantized GEMMs ran, the compiled / eager and
  fp8 / bf16 tokens/s ratios, and how far the compiled run's final loss is from the eager one's
  (same data, same seed: only rounding differs).

A section that checks something returns ``ok`` and, when not ok, ``why``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

# (precision.mode, train.compile) of every training run, in order: the bf16 pair first, so a short
# budget still yields the compiled-vs-eager ratio
RUNS = [("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True)]
_KEPT = ("tokens_per_s", "mfu", "step_time_median_s", "compile_s", "compiled", "moe_backend", "precision",
         "precision_impl", "precision_probe_error", "loss_first", "loss_last", "timed_steps")
_BREAKDOWN = ("time_breakdown_s", "time_breakdown_backward_s", "breakdown_step_s", "breakdown_steps")
# a training run that takes longer than this has hung (a compiled small run takes about a minute)
RUN_TIMEOUT_S = 240.0
# the learning check: a run on learnable data must end this share below its baseline (the lr=0
# run's final loss, else its own first step's); the lr=0 control must not clear it against its own
# first step (tests/kernels/test_kernels_gpu.py shows both verdicts)
LEARN_MIN_DROP = 0.05
# every run on markov data, the same batches for every run of a preset, over 256 tokens (tiny's
# vocabulary): learnable in a few steps. On CPU, small over its own 4096 tokens fell 8.38 -> 8.06
# (4%) in 12 steps at the default lr, over 256 tokens 5.59 -> 4.01 in 12 and -> 1.43 in 30
MARKOV = ("train.data=markov", "model.vocab_size=256", "train.warmup_steps=1")
# the phases a single-GPU MoE step must spend time in (dispatch and combine may be inside a fused
# CPU kernel's experts phase; dense needs a dense layer or shared expert)
CLOCKED_PHASES = ("attention", "router", "experts", "head_loss", "optimizer")
# how far the step the phases partition may be from the timed median (one process: the clock's
# events lie inside the timer's interval, so only the host time between them separates the two)
PHASE_SUM_RTOL = 0.05


def run_name(precision: str, compiled: bool) -> str:
    return f"{precision}_{'compiled' if compiled else 'eager'}"


def train_once(preset: str, device: str, precision: str, compiled: bool, steps: int,
               timeout_s: float, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``moebench train`` run in a subprocess: the record's main fields and its phase breakdown,
    or its error (``extra``: more ``section.field=value`` settings)."""
    cmd = [sys.executable, "-m", "moebench.cli", "train", "--preset", preset, "--steps", str(steps),
           "--set", f"train.device={device}", "--set", f"precision.mode={precision}",
           "--set", f"train.compile={str(compiled).lower()}", "--json"]
    cmd += [a for item in extra for a in ("--set", item)]
    record, error = train_record(cmd, timeout_s)
    return {"error": error} if record is None else {key: record.get(key) for key in _KEPT + _BREAKDOWN}


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
    """Every run of :data:`RUNS` on the check's device (``small``; ``tiny`` with ``--small``), on
    markov data, so that a compiled run that does not train ends far from the eager one."""
    preset, steps = ("tiny", 3) if ctx["small"] else ("small", 12)
    out: dict[str, Any] = {"preset": preset, "steps": steps}
    for precision, compiled in RUNS:
        name = run_name(precision, compiled)
        left = ctx["deadline"] - time.monotonic()
        if left < 30:
            out[name] = {"skipped": "time budget"}
            continue
        timeout = min(left, RUN_TIMEOUT_S)
        run = train_once(preset, ctx["device"].type, precision, compiled, steps, timeout, MARKOV)
        if timeout < RUN_TIMEOUT_S and str(run.get("error", "")).startswith("timed out"):
            # cut short by the section's budget, not by the hang limit: the lowest-priority runs
            # (fp8 compiled last) give way, as later sections do when the check runs out of time
            run = {"skipped": f"time budget ({run['error']})"}
        out[name] = run
    out.update(training_ratios(out))
    return out


def learned(run: dict[str, Any], baseline: float | None = None) -> bool | None:
    """Whether a finished run's final loss is :data:`LEARN_MIN_DROP` below ``baseline`` (default:
    its own first step's loss); None for an unfinished run."""
    base = run.get("loss_first") if baseline is None else baseline
    if base is None or run.get("loss_last") is None:
        return None
    return (base - run["loss_last"]) / abs(base) >= LEARN_MIN_DROP


def markov_steps(ctx: dict[str, Any]) -> tuple[str, int]:
    """The preset and steps of every markov-data run that checks learning (all alike, so each can
    be held against the learning section's lr=0 control)."""
    return ("tiny", 12) if ctx["small"] else ("small", 30)


def section_learning(ctx: dict[str, Any]) -> dict[str, Any]:
    """Does training train? Markov data, eager, at the default lr and at lr=0: the first must end
    :data:`LEARN_MIN_DROP` below the second's final loss; the second, the negative control, must
    not get that far below its own first step."""
    preset, steps = markov_steps(ctx)
    out: dict[str, Any] = {"preset": preset, "steps": steps, "min_drop": LEARN_MIN_DROP}
    for name, extra in (("default_lr", ()), ("control_lr0", ("train.lr=0",))):
        left = ctx["deadline"] - time.monotonic()
        if left < 20:
            out[name] = {"skipped": "time budget"}
            continue
        out[name] = train_once(preset, ctx["device"].type, "auto", False, steps, left, (*MARKOV, *extra))
    control, trained = out["control_lr0"], out["default_lr"]
    control["learned"] = learned(control)
    trained["learned"] = learned(trained, control.get("loss_last"))
    out["ok"] = trained["learned"] is True and control["learned"] is False
    unfinished = [f"{name}: {out[name].get('error') or out[name].get('skipped')}"
                  for name in ("default_lr", "control_lr0") if out[name].get("loss_last") is None]
    if unfinished:
        out["why"] = "; ".join(unfinished)
    elif not out["ok"]:
        out["why"] = (f"the default-lr run must end {LEARN_MIN_DROP:.0%} below the lr=0 run "
                      f"({trained.get('loss_last')} vs {control.get('loss_last')}: {trained['learned']}) and the "
                      f"lr=0 control must not ({control.get('loss_first')} -> {control.get('loss_last')}: "
                      f"{control['learned']})")
    return out


def _markov_run(ctx: dict[str, Any], precision: str, extra: tuple[str, ...]) -> dict[str, Any]:
    """One eager markov-data run (as the learning section's) and whether it learned, against the
    learning section's lr=0 control where the parent passed its final loss on."""
    preset, steps = markov_steps(ctx)
    run = train_once(preset, ctx["device"].type, precision, False, steps,
                     max(1.0, ctx["deadline"] - time.monotonic()), (*MARKOV, *extra))
    baseline = ctx.get("markov_control_loss")
    run.update(preset=preset, steps=steps, baseline="lr=0 control" if baseline is not None else "first step",
               learned=learned(run, baseline))
    return run


def _not_trained(run: dict[str, Any]) -> list[str]:
    """Why a finished :func:`_markov_run` failed to learn (empty when it learned)."""
    if run["learned"] is True:
        return []
    return [f"did not train: {run['loss_first']} -> {run['loss_last']} (baseline {run['baseline']})"]


def section_scope_linear(ctx: dict[str, Any]) -> dict[str, Any]:
    """fp8 with ``precision.scope=linear`` trains (native where the device runs fp8 natively)."""
    run = _markov_run(ctx, "fp8", ("precision.scope=linear",))
    if "error" in run:
        return run
    problems = _not_trained(run)
    run["ok"] = not problems
    if problems:
        run["why"] = problems[0]
    return run


def section_triton_training(ctx: dict[str, Any]) -> dict[str, Any]:
    """``moe.backend=triton`` through the trainer trains, and the record says triton ran."""
    if ctx["device"].type != "cuda":
        return {"skipped": "needs CUDA"}
    run = _markov_run(ctx, "auto", ("moe.backend=triton",))
    if "error" in run:
        return run
    problems = [] if run["moe_backend"] == "triton" else [f"the record says {run['moe_backend']} ran"]
    problems += _not_trained(run)
    run["ok"] = not problems
    if problems:
        run["why"] = "; ".join(problems)
    return run


def phase_clock_problems(run: dict[str, Any]) -> list[str]:
    """What is wrong with a run's timed-step breakdown: missing, a negative named phase, a phase of
    :data:`CLOCKED_PHASES` with no time (or experts with none in backward), phases that do not sum
    to the step they partition, or that step not within :data:`PHASE_SUM_RTOL` of the timed median."""
    phases, backward = run.get("time_breakdown_s"), run.get("time_breakdown_backward_s") or {}
    step, timed = run.get("breakdown_step_s"), run.get("step_time_median_s")
    if not phases or not step or not timed:
        return ["no time_breakdown_s / breakdown_step_s in the record"]
    # other is the rest of the median step: negative when the phases vary from step to step
    problems = [f"{p} {v:.2e} s < 0" for p, v in phases.items() if v < 0 and p != "other"]
    problems += [f"no time in {p}" for p in CLOCKED_PHASES if not phases.get(p, 0) > 0]
    if not backward.get("experts", 0) > 0:
        problems.append("no backward time in experts")
    total = sum(phases.values())
    if abs(total - step) > 1e-6 * step:
        problems.append(f"phases sum to {total:.4f} s, the step they partition took {step:.4f} s")
    if abs(step - timed) > PHASE_SUM_RTOL * timed:
        problems.append(f"the clock's median step is {step:.4f} s, the timed median {timed:.4f} s")
    return problems


def section_phase_clock(ctx: dict[str, Any]) -> dict[str, Any]:
    """One eager run: the step clock's breakdown must partition the timed step
    (:func:`phase_clock_problems`)."""
    preset, steps = ("tiny", 3) if ctx["small"] else ("small", 8)
    run = train_once(preset, ctx["device"].type, "auto", False, steps,
                     max(1.0, ctx["deadline"] - time.monotonic()), MARKOV)
    if "error" in run:
        return run
    problems = phase_clock_problems(run)
    run.update(preset=preset, steps=steps, ok=not problems)
    if problems:
        run["why"] = "; ".join(problems)
    return run


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
