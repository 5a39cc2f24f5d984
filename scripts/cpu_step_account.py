"""Where a CPU training step's time goes, by kind of kernel, for the comparisons of docs/cpu-experts.md.

Sides (each in a fresh process, interleaved round by round, as ``moebench bench e2e`` runs them):

- ``moebench``: the real trainer (``Trainer.step_once``) at ``moebench bench e2e``'s shape;
- ``moebench_compiled``: the same with ``train.compile=true``;
- ``transformers``: ``OlmoeForCausalLM`` and the step ``moebench bench e2e`` times for it;
- ``layer_cpu_fused`` / ``layer_ceiling``: ``moebench bench moe-layer``'s ``moe_cpu_fused`` and
  ``expert_gemms`` cases at the e2e layer's shape (1024 tokens, d 512, hidden 256, 32 experts top-4).

Each process warms up, times ``--steps`` unprofiled steps (their median is ``step``), then profiles
as many more and splits their time by :mod:`moebench.metrics.op_account` (the profiled step runs
slower than ``step``: ``profiled`` and ``between_ops`` show by how much). Printed: each side's
median over rounds of every class, ms a step, and the bounds docs/cpu-experts.md argues from.

    python scripts/cpu_step_account.py --rounds 3 --precision fp32 bf16
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

E2E_SIDES = ("moebench", "moebench_compiled", "transformers")
LAYER_SIDES = ("layer_cpu_fused", "layer_ceiling")
SIDES = E2E_SIDES + LAYER_SIDES


def _moebench_step(precision: str, compiled: bool) -> Callable[[], None]:
    from moebench.bench.e2e import E2EShape, Timing, moebench_overrides
    from moebench.presets import load_config
    from moebench.train.run import build_strategy, compute_dtype
    from moebench.train.trainer import Trainer

    cfg = load_config("tiny", moebench_overrides(E2EShape(), precision, Timing(), compiled))
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cpu")
    trainer = Trainer(cfg, build_strategy(cfg, device, None, precision), device, compute_dtype(precision))
    steps = itertools.count()
    return lambda: trainer.step_once(next(steps))


def _transformers_step(precision: str) -> Callable[[], None]:
    from moebench.bench import e2e_hf
    from moebench.bench.e2e import E2EShape, Timing, transformers_command

    shape = E2EShape()
    args = e2e_hf.parse_args(transformers_command(shape, precision, Timing())[3:])
    model = e2e_hf.build_model(json.loads(args.olmoe), args.experts, args.seed)
    step = e2e_hf.training_step(model, e2e_hf.build_optimizer(model, args), args, [])
    gen = torch.Generator().manual_seed(args.seed)
    return lambda: step(torch.randint(model.config.vocab_size, (shape.micro_batch, shape.seq_len), generator=gen))


def _layer_step(precision: str, case: str) -> Callable[[], None]:
    from moebench.bench.e2e import E2EShape
    from moebench.bench.moe_layer import LayerShape, cases

    e = E2EShape()
    shape = LayerShape(tokens=e.micro_batch * e.seq_len, d_model=e.d_model, hidden=e.hidden, experts=e.experts,
                       top_k=e.top_k)
    torch.manual_seed(0)
    return cases(shape, torch.bfloat16 if precision == "bf16" else torch.float32, include_loop=False)[case]


def build_step(side: str, precision: str) -> Callable[[], None]:
    if side in ("moebench", "moebench_compiled"):
        return _moebench_step(precision, side == "moebench_compiled")
    if side == "transformers":
        return _transformers_step(precision)
    return _layer_step(precision, {"layer_cpu_fused": "moe_cpu_fused", "layer_ceiling": "expert_gemms"}[side])


def measure(side: str, precision: str, warmup: int, steps: int) -> dict[str, float]:
    """One process's figures, seconds a step: ``step`` (unprofiled median), ``profiled`` and each class."""
    from torch.profiler import ProfilerActivity, profile

    from moebench.metrics.op_account import account

    step = build_step(side, precision)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        profiled = time.perf_counter() - started
    classes = account(prof.events())
    out = {"step": statistics.median(times), "profiled": profiled / steps}
    out.update({name: s / steps for name, s in classes.items()})
    out["between_ops"] = out["profiled"] - sum(classes.values()) / steps
    return out


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _ratio_line(label: str, per_round: list[float]) -> str:
    """A ratio taken within each round (its processes ran minutes apart at most), median and every round."""
    rounds = ", ".join(f"{r:.2f}" for r in per_round)
    return f"  {label}: {statistics.median(per_round):.2f}x (rounds: {rounds})"


def ratios(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """The figures docs/cpu-experts.md argues from, each taken round by round (one precision's runs by side)."""
    lines = []
    rounds = range(min(len(r) for r in runs.values()))

    def shared(r: dict[str, float]) -> float:  # what any implementation pays: torch's kernels for the same math
        return r["gemm"] + r["attention_kernel"] + r["optimizer"]

    if "moebench" in runs and "transformers" in runs:
        mb, hf = runs["moebench"], runs["transformers"]
        lines.append(_ratio_line("transformers / moebench step", [hf[i]["step"] / mb[i]["step"] for i in rounds]))
        lines.append(_ratio_line("transformers step / moebench's GEMMs + attention kernel + optimizer",
                                 [hf[i]["step"] / shared(mb[i]) for i in rounds]))
    if "moebench" in runs:
        mb = runs["moebench"]
        # within one process's profiled steps: drift between processes does not enter
        lines.append(_ratio_line("moebench profiled step / its GEMMs + attention kernel + optimizer",
                                 [r["profiled"] / shared(r) for r in mb]))
        kept = [shared(r) + r["expert_op_copies"] + r["expert_op_other"] for r in mb]  # what inductor leaves
        lines.append(_ratio_line("compile's bound: eager profiled step / what inductor leaves as is (those and "
                                 "the expert op)", [r["profiled"] / k for r, k in zip(mb, kept, strict=True)]))
        if "moebench_compiled" in runs:
            lines.append(_ratio_line("eager / compiled step",
                                     [mb[i]["step"] / runs["moebench_compiled"][i]["step"] for i in rounds]))
    if "layer_cpu_fused" in runs and "layer_ceiling" in runs:
        fused, ceiling = runs["layer_cpu_fused"], runs["layer_ceiling"]
        lines.append(_ratio_line("layer: ceiling / cpu_fused", [ceiling[i]["step"] / fused[i]["step"] for i in rounds]))
        lines.append(_ratio_line("layer: cpu_fused's GEMMs / its profiled step",
                                 [r["gemm"] / r["profiled"] for r in fused]))
    return lines


def report(results: dict[tuple[str, str], list[dict[str, float]]]) -> list[str]:
    lines = []
    for precision in sorted({p for _, p in results}):
        runs = {side: r for (side, p), r in results.items() if p == precision}
        med = {side: _medians(r) for side, r in runs.items()}
        sides = [s for s in SIDES if s in med]
        lines.append(f"{precision}: ms a step, medians of {min(map(len, runs.values()))} processes a side")
        lines.append(f"{'class':18s}" + "".join(f"{s:>19s}" for s in sides))
        for key in med[sides[0]]:
            lines.append(f"{key:18s}" + "".join(f"{med[s][key] * 1e3:19.1f}" for s in sides))
        lines.extend(ratios(runs))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write every process's figures here")
    parser.add_argument("--one", nargs=2, metavar=("SIDE", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one, args.warmup, args.steps)))
        return
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for precision in args.precision:
            for side in args.sides:
                cmd = [sys.executable, __file__, "--one", side, precision, "--warmup", str(args.warmup),
                       "--steps", str(args.steps)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{side} {precision} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
                results.setdefault((side, precision), []).append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"round {round_ + 1} {precision} {side}: step "
                      f"{results[(side, precision)][-1]['step'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"side": s, "precision": p, "runs": r} for (s, p), r in results.items()], f, indent=1)


if __name__ == "__main__":
    main()
