"""The GPU check: one command that anyone with a CUDA GPU runs (``scripts/gpu_check.sh OUT_DIR``).

Shapes: T tokens, D model dim, H expert hidden, E experts, K top-k; N = T * K expert rows.

Each section runs in a process of its own (``--section NAME``), in the priority order and with
the time budget of :data:`SECTIONS` as a hard timeout, so a device-side assert (which poisons a
CUDA context for good), a hang or a crash costs that section alone; results are rewritten to
``OUT_DIR/gpu_check.json`` after every section, so a timeout of the whole keeps what finished.
Each section gets a verdict (:func:`section_verdict`): PASS, FAIL (a wrong result, a crash, a
timeout), WARN (a speed target missed) or SKIP; the check exits 1 when any section FAILs.
``--plugin MODULE`` appends a module's own ``SECTIONS`` (the tests use it for a crashing one).

Sections, in priority order (:data:`SECTIONS`):

1. ``dense``: the dense bf16 matmul rate measured in this run: ``[N, D] @ [D, 3H]`` forward and
   forward+backward, the same FLOPs as the MoE layer's expert GEMMs; doubles as the MFU
   plausibility check: the rate must lie within :data:`PLAUSIBLE_DENSE_SHARE` of the device
   table's bf16 peak.
2. ``precision``: the Triton MXFP8 and FP8 rowwise quantizers vs their torch references on the
   device (bit-exact), the bandwidth of each and of its reference, and for each format that runs
   natively (fp8, mxfp8) the native vs emulated error of a grouped GEMM's output and both
   gradients, and its error against the bf16 product, at routed and ragged group sizes (not
   multiples of 16, empty groups).
3. ``sync_free``: MoE forward+backward under ``torch.cuda.set_sync_debug_mode("error")`` for the
   device-resident paths; the ``loop`` backend (which reads offsets on the host) is the
   positive control that must raise.
4. ``learning``, 5. ``scope_linear``, 6. ``phase_clock``, 7. ``triton_training``: ``moebench
   train`` runs that check training (:mod:`moebench.bench.training_runs`): markov data at the
   default lr must end 5% below the lr=0 run, which is the negative control; fp8 with
   ``precision.scope=linear`` trains; the timed steps' phases partition them; ``moe.backend=triton``
   through the trainer trains and is recorded as triton.
8. ``moe_layer``: MoE layer forward+backward TFLOP/s (expert GEMM FLOPs ``6 N 3 D H``; router,
   permute and combine count against it) for: grouped_mm, triton (as ``moe.backend=triton``
   trains: the block's own dispatcher, Triton expert GEMMs), and the fp8 / mxfp8 expert
   precisions, each with its ``precision_impl``; ratios to the dense rate.
9. ``tests``: the CUDA-only tests (``pytest -m gpu``).
10. ``training``: ``moebench train --preset small`` compiled vs eager (``train.compile``), in bf16
    and fp8, on markov data, each in its own process: tokens/s, MFU, compile time, compiled /
    eager and fp8 / bf16 ratios, and the compiled run's final-loss change.
11. ``grouped_gemm``: torch's grouped GEMM vs the Triton one (forward, and forward+backward),
    one ``[N, D] @ [E, D, 2H]`` GEMM with random routing.
12. ``nvml_overhead``: MoE steps with one more NVML sampler (the trainer's interval) polling vs
    without, interleaved rounds; the target is under 1% slower.
13. ``layouts`` (only with ``--ranks N``, N GPUs): fsdp, ddp with EP sync and row-wise, the
    distributed optimizer and a 2-stage pipeline on N ranks against one process, losses and
    tokens/s (:mod:`moebench.bench.layout_parity`).

The parent also samples NVML (:mod:`moebench.metrics.nvml`) around all of them (``nvml``).

Targets (H200, T=16384 D=2048 H=1024 E=64 K=8, bf16): MoE layer >= 0.8 of the dense rate;
Triton grouped GEMM >= 0.9 of torch's; a compiled run's final loss within 1% of the eager one's
(bf16 rounding only). ``--small --device cpu`` runs the CPU-safe parts on toy shapes and the
training runs on ``tiny`` (used by the tests).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from moebench.bench.gpu_sections import (
    section_dense,
    section_grouped_gemm,
    section_moe_layer,
    section_nvml_overhead,
    section_precision,
    section_sync_free,
    section_tests,
    start_nvml,
    stop_nvml,
)
from moebench.bench.gpu_summary import format_table, summary_rows
from moebench.bench.layout_parity import check_ranks, section_layouts
from moebench.bench.moe_layer import LayerShape
from moebench.bench.training_runs import (
    section_learning,
    section_phase_clock,
    section_scope_linear,
    section_training,
    section_triton_training,
)
from moebench.launch.tree import run_process
from moebench.metrics.flops import gpu_peak_flops

BUDGET_S = 540.0  # stay inside 9.5 minutes (scripts/gpu_check.sh) with margin for start-up and the table


TARGET = LayerShape(tokens=16384, d_model=2048, hidden=1024, experts=64, top_k=8)  # the H200 target shape
SMALL = LayerShape(tokens=64, d_model=64, hidden=32, experts=4, top_k=2)


def _write(out_dir: Path, results: dict[str, Any]) -> None:
    path = out_dir / "gpu_check.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


SectionFn = Callable[[dict[str, Any]], dict[str, Any]]

# (name, function, budget in seconds), in priority order: the dense rate first (later sections
# compare against it), then what catches wrong results (numerics, syncs, training that trains,
# the phase clock, the kernels' own tests), then speed; the budgets sum to BUDGET_S. Each section
# runs in a process of its own with its budget as a hard timeout, so a device-side assert, a hang
# or a crash costs that section alone. The budgets are estimates for one H200 (a section's
# `wall_s` in the JSON says what it took): a ``moebench train`` run is about 10-20 s of start-up
# and a compiled one adds its compile time.
SECTIONS: list[tuple[str, SectionFn, float]] = [
    ("dense", section_dense, 25),
    ("precision", section_precision, 45),
    ("sync_free", section_sync_free, 35),
    ("learning", section_learning, 60),
    ("scope_linear", section_scope_linear, 40),
    ("phase_clock", section_phase_clock, 35),
    ("triton_training", section_triton_training, 50),
    ("moe_layer", section_moe_layer, 45),
    ("tests", section_tests, 60),
    ("training", section_training, 105),
    ("grouped_gemm", section_grouped_gemm, 25),
    ("nvml_overhead", section_nvml_overhead, 15),
]
MIN_SECTION_S = 10.0  # a section that would get less than this is skipped ("time budget")
# what a section's process may spend starting (python, torch, a CUDA context) beyond its budget
# before it is killed; the whole check still stops at BUDGET_S
START_ALLOWANCE_S = 30.0
# the dense fwd+bwd rate as a share of the device's datasheet peak (MFU plausibility): above the
# peak the FLOP count, the peak or the clock is wrong; below 30% the GEMM did not run on the tensor
# cores at full clock (a wrong dtype or layout, a throttled or shared GPU) and every ratio to it
# is suspect (moebench.devices has the peaks)
PLAUSIBLE_DENSE_SHARE = (0.3, 1.0)


# with --ranks N: the multi-GPU layout check, after the single-GPU sections
LAYOUT_SECTION: tuple[str, SectionFn, float] = ("layouts", section_layouts, 180)


def all_sections(plugin: str | None, ranks: int | None = None) -> list[tuple[str, SectionFn, float]]:
    """The built-in sections (and the layout check with ``ranks``), then ``plugin``'s (a module
    with a ``SECTIONS`` list of the same shape)."""
    own = [*SECTIONS, *([LAYOUT_SECTION] if ranks else [])]
    if plugin is None:
        return own
    return [*own, *importlib.import_module(plugin).SECTIONS]


def _passes(ok: bool | None, why: str) -> tuple[str, str]:
    return ("PASS", "") if ok else ("FAIL", why)


def section_verdict(name: str, result: dict[str, Any], device_peak: float | None = None) -> tuple[str, str]:
    """``(PASS | FAIL | WARN | SKIP, why)`` of one section's result. FAIL is a wrong result, a
    crash or a timeout; WARN a speed target missed (it does not fail the check); SKIP a section
    that did not apply here or had no time left."""
    if "skipped" in result:
        return "SKIP", str(result["skipped"])
    if "error" in result:
        return "FAIL", str(result["error"])[:200]
    if name == "tests":
        return _passes(result.get("ok"), f"pytest -m gpu: {result.get('summary')}")
    if name == "dense":
        tflops = (result.get("fwd_bwd") or {}).get("tflops")
        if device_peak and tflops:
            share = tflops * 1e12 / device_peak
            lo, hi = PLAUSIBLE_DENSE_SHARE
            return _passes(lo <= share <= hi, f"dense rate {share:.2f} of the datasheet peak, outside [{lo}, {hi}]")
        return _passes(tflops is not None and tflops > 0, "no dense rate")
    if name == "precision":
        bad = [k for k, v in result.items() if k.endswith("_bit_exact") and v is False]
        bad += [f"{k} {v:.1e}" for k, v in result.items() if "_native_vs_emulated_" in k and v >= 1e-2]
        return _passes(not bad, ", ".join(bad))
    if name == "sync_free":
        return _passes(result.get("ok"), "a device-resident path synced, or the loop control did not")
    if name == "moe_layer":
        errors = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
        if errors:
            return "FAIL", f"cases failed: {', '.join(errors)}"
        slow = [k for k in ("grouped_mm", "triton") if (result.get(k) or {}).get("vs_dense", 1.0) < 0.8]
        return ("WARN", f"below 0.8 of the dense rate: {', '.join(slow)}") if slow else ("PASS", "")
    if name == "training":
        errors = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
        drift = [k for k, v in result.items() if k.endswith("_compiled_loss_rel_diff") and v >= 1e-2]
        return _passes(not errors and not drift, f"runs failed: {errors}; compiled loss off by >= 1%: {drift}")
    if name == "layouts":
        return _passes(result.get("ok"), f"layouts failed or did not run: {result.get('failed') or 'see the table'}")
    if name == "grouped_gemm":
        ratio = result.get("triton_vs_torch_fwd_bwd")
        return ("WARN", f"triton / torch {ratio:.2f} < 0.9") if ratio is not None and ratio < 0.9 else ("PASS", "")
    if name == "nvml":
        if result.get("nvml_peak_mem_used_bytes") is None:
            return "FAIL", "NVML gave no memory reading"
        if result.get("throttled"):
            return "WARN", f"throttled: {', '.join(result.get('nvml_throttle_reasons') or [])} (speed rows suspect)"
        if result.get("nvml_energy_j") is None:
            return "WARN", "NVML reports no energy counter"
        return "PASS", ""
    if name == "nvml_overhead":
        over = result.get("overhead")
        return ("WARN", f"sampler overhead {over:+.1%}") if over is not None and over >= 0.01 else ("PASS", "")
    return _passes(result.get("ok", True), str(result.get("why", "section reported ok=false"))[:300])


def run_section(name: str, out_dir: Path, argv: list[str], timeout_s: float,
                allowance_s: float = START_ALLOWANCE_S) -> dict[str, Any]:
    """Section ``name`` in a child process (``argv`` are this check's own options), killed after
    ``timeout_s`` and ``allowance_s`` to start; its result, or why none came."""
    folder = out_dir / "sections"
    folder.mkdir(parents=True, exist_ok=True)
    result_path, log_path = folder / f"{name}.json", folder / f"{name}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "moebench.bench.gpu_check", str(out_dir), "--section", name,
           "--section-timeout", f"{timeout_s:.0f}", *argv]
    log_path.unlink(missing_ok=True)
    # its own process group, killed whole on a timeout: a training section's `moebench train` too
    outcome = run_process(cmd, log_path, timeout_s + allowance_s)
    if result_path.exists():
        return json.loads(result_path.read_text())
    code = outcome.returncode
    tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["no output"]
    if outcome.timed_out:
        return {"error": f"timed out: its budget of {timeout_s:.0f} s and {allowance_s:.0f} s to start "
                         f"(log: {log_path})"}
    return {"error": f"section process exited {code} with no result: {tail[0][:300]} (log: {log_path})"}


def _child(args: argparse.Namespace, ctx: dict[str, Any]) -> int:
    """``--section NAME``: run that one section here and write its result (the parent reads it)."""
    sections = {n: fn for n, fn, _ in all_sections(args.plugin, args.ranks)}
    ctx["deadline"] = time.monotonic() + args.section_timeout - 5
    ctx.update(json.loads(args.context or "{}"))
    t0 = time.monotonic()
    try:
        result = sections[args.section](ctx)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-3000:]}
    result["wall_s"] = time.monotonic() - t0
    folder = args.out_dir / "sections"
    tmp = folder / f"{args.section}.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(folder / f"{args.section}.json")
    return 0


def section_context(sections: dict[str, Any]) -> dict[str, Any]:
    """What the parent hands every later section from the earlier ones' results: the dense rates
    (the MoE layer's and grouped GEMM's ratios) and the lr=0 control's final loss (the baseline of
    the markov runs that check learning)."""
    dense = sections.get("dense", {})
    control = (sections.get("learning") or {}).get("control_lr0") or {}
    return {"dense_fwd_tflops": (dense.get("fwd") or {}).get("tflops", float("nan")),
            "dense_fwd_bwd_tflops": (dense.get("fwd_bwd") or {}).get("tflops", float("nan")),
            "markov_control_loss": control.get("loss_last")}


def verdict_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(section, verdict, why) rows, in the order the sections ran."""
    return [(name, v["verdict"], v["why"]) for name, v in results["verdicts"].items()]


def _parser() -> argparse.ArgumentParser:
    """The options of ``moebench gpu-check``; the hidden ones serve a section's own process and the tests."""
    parser = argparse.ArgumentParser(
        prog="moebench gpu-check",
        description="CUDA tests, grouped GEMM and MoE layer rates vs the dense matmul, fp8/mxfp8 vs bf16, "
                    "sync-free routing, training that trains, and NVML; each section in its own process; "
                    "writes OUT_DIR/gpu_check.json, prints a verdict per section last; exit 1 if any FAILs.")
    parser.add_argument("out_dir", type=Path, help="folder for gpu_check.json")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="toy shapes (CPU smoke test)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--ranks", type=int, default=None,
                        help="also check every parallel layout on this many GPUs against one (even, 2-8)")
    parser.add_argument("--plugin", default=None, help="a module whose SECTIONS run after the built-in ones")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child: run this one section
    parser.add_argument("--section-timeout", type=float, default=BUDGET_S, help=argparse.SUPPRESS)
    parser.add_argument("--context", default=None, help=argparse.SUPPRESS)
    # what a section's process may spend starting; the orchestration test shortens it
    parser.add_argument("--start-allowance", type=float, default=START_ALLOWANCE_S, help=argparse.SUPPRESS)
    return parser


def _run_sections(args: argparse.Namespace, device: torch.device, results: dict[str, Any], skip: set[str],
                  peak: float | None, deadline: float) -> None:
    """Every section but nvml in its own process, in priority order, within what is left before
    ``deadline``: its result and verdict into ``results``, rewritten to OUT_DIR after each."""
    child_argv = ["--device", device.type, "--repeats", str(args.repeats), *(["--small"] if args.small else []),
                  *(["--plugin", args.plugin] if args.plugin else []),
                  *(["--ranks", str(args.ranks)] if args.ranks else [])]
    for name, _, budget in all_sections(args.plugin, args.ranks):
        left = deadline - time.monotonic()
        if name in skip:
            result: dict[str, Any] = {"skipped": "--skip"}
        elif left - args.start_allowance < MIN_SECTION_S:
            result = {"skipped": "time budget"}
        else:
            context = section_context(results["sections"])
            result = run_section(name, args.out_dir, [*child_argv, "--context", json.dumps(context)],
                                 min(budget, left - args.start_allowance), args.start_allowance)
        results["sections"][name] = result
        verdict, why = section_verdict(name, result, peak)
        results["verdicts"][name] = {"verdict": verdict, "why": why}
        _write(args.out_dir, results)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ranks is not None:
        try:
            check_ranks(args.ranks)
        except ValueError as exc:
            parser.error(str(exc))

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    shape = SMALL if args.small else TARGET
    ctx: dict[str, Any] = {
        "device": device, "shape": shape, "repeats": args.repeats, "small": args.small,
        "dtype": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "dense_fwd_tflops": float("nan"), "dense_fwd_bwd_tflops": float("nan"),
        "ranks": args.ranks,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.section is not None:
        return _child(args, ctx)
    deadline = time.monotonic() + BUDGET_S
    results: dict[str, Any] = {
        "schema_version": 2,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__, "shape": asdict(shape), "dtype": str(ctx["dtype"]).removeprefix("torch."),
        "sections": {}, "verdicts": {},
    }
    # the datasheet peak the dense rate must be plausible against (none on CPU: its peak is itself measured)
    peak = gpu_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    skip = {s for s in args.skip.split(",") if s}
    sampler = start_nvml(device) if "nvml" not in skip else None
    _run_sections(args, device, results, skip, peak, deadline)
    results["sections"]["nvml"] = {"skipped": "--skip"} if "nvml" in skip else stop_nvml(sampler)
    verdict, why = section_verdict("nvml", results["sections"]["nvml"])
    results["verdicts"]["nvml"] = {"verdict": verdict, "why": why}
    failed = [n for n, v in results["verdicts"].items() if v["verdict"] == "FAIL"]
    results["verdict"] = "FAIL" if failed else "PASS"
    _write(args.out_dir, results)
    print(f"gpu check: {results['device']} ({results['dtype']}, T={shape.tokens} D={shape.d_model} "
          f"H={shape.hidden} E={shape.experts} K={shape.top_k}); full results in {args.out_dir / 'gpu_check.json'}")
    print(format_table(summary_rows(results)))
    print()
    print(format_table(verdict_rows(results)))
    print(f"gpu check {results['verdict']}" + (f": {len(failed)} section(s) failed ({', '.join(failed)})"
                                               if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
