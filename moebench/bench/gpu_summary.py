"""The GPU check's final table: one (metric, value, target/status) row per figure of every section
(:mod:`moebench.bench.gpu_check` prints it after the verdicts)."""

from __future__ import annotations

from typing import Any

from moebench.bench.layout_parity import layout_rows
from moebench.bench.training_runs import (
    LEARN_MIN_DROP,
    RUNS,
    run_name,
)
from moebench.precision_modes import QUANT_MODES


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, value, target/status) rows of the final table."""
    sec = results["sections"]
    layouts = sec.get("layouts")
    return [*_kernel_rows(sec, results.get("dtype", "bf16")), *_precision_rows(sec), *training_check_rows(sec),
            *_training_rate_rows(sec),
            *(layout_rows(layouts) if isinstance(layouts, dict) and "ranks" in layouts else []), *_nvml_rows(sec)]


def _get(sec: dict[str, Any], *keys: str) -> Any:
    """``sec[keys[0]][keys[1]]...``, None where a key is missing."""
    node: Any = sec
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _verdict(v: float | None, target: float) -> str:
    return "n/a" if v is None else ("PASS" if v >= target else "FAIL") + f" (>= {target})"


def _kernel_rows(sec: dict[str, Any], dtype: str) -> list[tuple[str, str, str]]:
    """The CUDA tests, the dense and grouped GEMM rates, the MoE layer's, sync-free routing."""
    rows: list[tuple[str, str, str]] = []
    tests = _get(sec, "tests", "summary")
    rows.append(("cuda tests", tests or str(_get(sec, "tests", "skipped") or _get(sec, "tests", "error")), ""))
    rows.append((f"dense {dtype} fwd+bwd TFLOP/s", _fmt(_get(sec, "dense", "fwd_bwd", "tflops")), ""))
    rows.append(("grouped fwd torch TFLOP/s", _fmt(_get(sec, "grouped_gemm", "torch", "fwd", "tflops")), ""))
    rows.append(("grouped fwd triton TFLOP/s", _fmt(_get(sec, "grouped_gemm", "triton", "fwd", "tflops")), ""))
    ratio = _get(sec, "grouped_gemm", "triton_vs_torch_fwd_bwd")
    rows.append(("triton / torch (fwd+bwd)", _fmt(ratio, ".2f"), _verdict(ratio, 0.9)))
    for name in ("grouped_mm", "triton", *QUANT_MODES):
        row = _get(sec, "moe_layer", name) or {}
        if "tflops" in row:
            impl = f" [{row['precision_impl']}]" if name in QUANT_MODES else ""
            target = _verdict(row["vs_dense"], 0.8) if name in ("grouped_mm", "triton") else \
                f"{row.get('vs_bf16', float('nan')):.2f}x bf16"
            value = f"{row['tflops']:.1f} ({row['vs_dense']:.2f} dense)"
            rows.append((f"moe layer {name}{impl} TFLOP/s", value, target))
        else:
            rows.append((f"moe layer {name}", str(row.get("error") or row.get("skipped") or "-")[:60], ""))
    sync_ok = _get(sec, "sync_free", "ok")
    rows.append(("sync-free routing", "-" if sync_ok is None else str(sync_ok), "PASS" if sync_ok else
                 ("n/a" if sync_ok is None else "FAIL")))
    return rows


def _precision_rows(sec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The quantizers' Triton twins bit-exact, ragged groups, native vs emulated quantized GEMMs."""
    rows: list[tuple[str, str, str]] = []
    rows.append(("mxfp8 triton bit-exact", str(_get(sec, "precision", "mxfp8_triton_bit_exact")), ""))
    rows.append(("fp8 rowwise triton bit-exact", str(_get(sec, "precision", "fp8_triton_bit_exact")), ""))
    ragged = [_get(sec, "precision", "offsets", case) for case in ("routed", "ragged")]
    if all(ragged):
        rows.append(("quantized GEMM groups not a multiple of 16 (routed, ragged)",
                     ", ".join(f"{r['unaligned_16']}/{r['groups']}" for r in ragged), ""))
    for fmt in QUANT_MODES:
        errs = [_get(sec, "precision", f"{fmt}_native_vs_emulated_{what}_rel_err")
                for what in ("out", "grad_a", "grad_w")]
        if all(e is not None for e in errs):  # only where the format ran natively
            rows.append((f"{fmt} native vs emulated rel err (out/dA/dW)", "/".join(f"{e:.1e}" for e in errs),
                         "PASS" if max(errs) < 1e-2 else "FAIL (< 1e-2)"))
    return rows


def _training_rate_rows(sec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The training runs' tokens/s, compiled vs eager, fp8 vs bf16."""
    rows: list[tuple[str, str, str]] = []
    for precision, compiled in RUNS:
        name = run_name(precision, compiled)
        run = _get(sec, "training", name) or {}
        if "tokens_per_s" in run:
            compile_s = f", compile {run['compile_s']:.0f} s" if run.get("compile_s") is not None else ""
            mfu = f", MFU {100 * run['mfu']:.1f}%" if run.get("mfu") is not None else ""
            rows.append((f"train {name} [{run['moe_backend']}, {run['precision_impl']}] tok/s",
                         f"{run['tokens_per_s']:,.0f}{mfu}{compile_s}", ""))
        elif run:
            rows.append((f"train {name}", str(run.get("error") or run.get("skipped"))[:60], ""))
    for precision in ("bf16", "fp8"):
        ratio = _get(sec, "training", f"{precision}_compiled_vs_eager")
        loss = _get(sec, "training", f"{precision}_compiled_loss_rel_diff")
        if ratio is not None:
            rows.append((f"train {precision} compiled / eager tok/s (loss change)", f"{ratio:.2f}x ({loss:.1e})",
                         ("PASS" if loss < 1e-2 else "FAIL") + " (loss < 1e-2)"))
    for mode in ("eager", "compiled"):
        ratio = _get(sec, "training", f"fp8_vs_bf16_{mode}")
        if ratio is not None:
            rows.append((f"train fp8 / bf16 tok/s ({mode})", f"{ratio:.2f}x", ""))
    return rows


def _nvml_rows(sec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The NVML sampler's overhead, and what it read: peak memory, energy, throttle reasons."""
    rows: list[tuple[str, str, str]] = []
    overhead = _get(sec, "nvml_overhead", "overhead")
    rows.append(("nvml sampler overhead (A/B)", "-" if overhead is None else f"{100 * overhead:+.2f}%",
                 "n/a" if overhead is None else ("PASS" if overhead < 0.01 else "FAIL") + " (< 1%)"))
    peak, energy = _get(sec, "nvml", "nvml_peak_mem_used_bytes"), _get(sec, "nvml", "nvml_energy_j")
    reasons = _get(sec, "nvml", "nvml_throttle_reasons")
    rows.append(("nvml peak mem GiB / energy kJ / throttle reasons",
                 "-" if peak is None else f"{peak / 2**30:.1f} / {'-' if energy is None else f'{energy / 1e3:.1f}'} / "
                 f"{','.join(reasons) if reasons else 'none'}", ""))
    return rows


def _loss(run: dict[str, Any]) -> str:
    return f"{run.get('loss_first', float('nan')):.3f} -> {run.get('loss_last', float('nan')):.3f}"


def training_check_rows(sec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows of the sections that check a ``moebench train`` run: learning, scope_linear,
    triton_training, phase_clock (a run that did not finish shows why)."""
    rows: list[tuple[str, str, str]] = []
    learning = sec.get("learning") or {}
    trained, control = learning.get("default_lr") or {}, learning.get("control_lr0") or {}
    if "loss_last" in trained and "loss_last" in control:
        rows.append(("learning: markov loss default lr | lr=0", f"{_loss(trained)} | {_loss(control)}",
                     f"default lr >= {LEARN_MIN_DROP:.0%} below lr=0; lr=0 not {LEARN_MIN_DROP:.0%} below its start"))
    for name, label in (("scope_linear", "scope=linear fp8"), ("triton_training", "moe.backend=triton")):
        run = sec.get(name) or {}
        if "loss_last" in run:
            rows.append((f"{label} [{run['moe_backend']}, {run['precision_impl']}] markov loss", _loss(run),
                         f">= {LEARN_MIN_DROP:.0%} below the {run['baseline']}"))
        elif run:
            rows.append((label, str(run.get("error") or run.get("skipped"))[:60], ""))
    clock = sec.get("phase_clock") or {}
    phases = clock.get("time_breakdown_s")
    if phases and clock.get("breakdown_step_s"):
        step = clock["breakdown_step_s"]
        top = sorted(phases.items(), key=lambda kv: -kv[1])[:3]
        rows.append(("phase clock: timed step ms (top phases)",
                     f"{1e3 * step:.1f} (" + ", ".join(f"{p} {v / step:.0%}" for p, v in top) + ")",
                     "phases sum to the timed step"))
    elif clock:
        rows.append(("phase clock", str(clock.get("error") or clock.get("skipped") or clock.get("why"))[:60], ""))
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>{vwidth}}  {c}" for a, b, c in rows)
