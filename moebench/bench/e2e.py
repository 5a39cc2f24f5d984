"""End to end: moebench's training loop against the loop a user would write with transformers.

Both sides train the same model shape (an OLMoE-style decoder: QK-norm over the full q and k
widths, no shared expert, no dense layers, untied head, softmax top-k routing with the
load-balancing loss) on random tokens with AdamW, in fp32 or in bf16 autocast with fp32
weights. Each side runs in its own fresh process, and the processes are *interleaved*: round r
runs moebench, then transformers, for each precision in turn (A B A B ...), so drift on a shared
machine hits both sides alike. Each process excludes its warm-up steps and times the same number
of steps on the same tokens per step; the ratio and its interval are computed from every round's
raw step times (``moebench bench e2e`` does that with :mod:`moebench.results.stats`).

Like for like beyond the model: both sides run torch's fused AdamW with weight decay on matrices
only (:func:`moebench.parallel.optimizer.adamw`, the rule moebench trains with), the same gradient
clip, sdpa attention and the same loss terms (cross-entropy plus the load-balancing loss at
OLMoE's 0.01, no z-loss). Each side runs its own RMSNorm (moebench's ``model.norm_impl=recompute``,
transformers' module of plain torch ops) and its own experts. Each row says what its side ran
(:data:`KERNEL_FIELDS`), and :func:`kernel_lines` prints it.

The moebench side is ``moebench train --json``; the transformers side is
:mod:`moebench.bench.e2e_hf`. transformers is an optional extra (``pip install 'moebench[e2e]'``,
or ``MOEBENCH_EXTRAS=e2e bash scripts/setup.sh``); without it only the moebench side runs.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moebench.bench.training_runs import train_record
from moebench.config import Config
from moebench.errors import ConfigError
from moebench.model.transformer import Transformer
from moebench.parallel.optimizer import adamw_kernel, build_adamw
from moebench.presets import load_config
from moebench.record import PHASES

PRECISIONS = ("fp32", "bf16")
MOEBENCH, COMPILED, TRANSFORMERS = "moebench", "moebench compiled", "transformers"
# transformers' expert paths offered here: torch's grouped GEMM ("grouped_mm", its default) and its
# per-expert loop ("eager"). Its "batched_mm" gathers one weight matrix per routed token (T*K x 3*D*H:
# 6.4 GB in fp32 at the default shape, forward alone), which ran this 23 GB machine out of memory.
HF_EXPERTS = ("grouped_mm", "eager")
# the keys a side's JSON line must carry; the rest of the line is kept as it came
_REQUIRED = ("step_times_s", "tokens_per_step")
# what each side's row says it ran, beside its times (moebench's from moebench_kernels and its record)
KERNEL_FIELDS = ("optimizer", "attention", "norm", "experts", "loss")


@dataclass
class E2EShape:
    """The model and batch both sides train. Defaults: the shape issue 29 measured (d_model 512, 4 layers,
    32 experts top-4, seq 256, micro-batch 4: 1024 tokens, 128 rows per expert a step), with OLMoE's
    expert hidden of d_model / 2."""

    vocab: int = 4096
    d_model: int = 512
    layers: int = 4
    heads: int = 8
    experts: int = 32
    top_k: int = 4
    hidden: int = 256
    seq_len: int = 256
    micro_batch: int = 4

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass
class Timing:
    warmup: int = 3  # steps run and discarded before the timed ones, on each side
    steps: int = 10  # timed steps per process
    rounds: int = 3  # fresh processes per side and precision
    hf_experts: str = "grouped_mm"
    timeout_s: float = 900.0  # one process
    phase_clock: bool = False  # moebench's time breakdown, taken inside its timed steps (train.phase_clock)


def moebench_overrides(shape: E2EShape, precision: str, timing: Timing, compiled: bool = False) -> list[str]:
    """``section.field=value`` settings that make ``moebench train --preset tiny`` train ``shape`` like OLMoE
    (``compiled``: each block under ``torch.compile``, ``train.compile=true``)."""
    return [
        f"model.vocab_size={shape.vocab}", f"model.d_model={shape.d_model}", f"model.n_layers={shape.layers}",
        f"model.n_heads={shape.heads}", f"model.n_kv_heads={shape.heads}", "model.qk_norm=true",
        "model.qk_norm_scope=full", f"model.seq_len={shape.seq_len}", "model.n_dense_layers=0",
        "model.norm_impl=recompute",  # moebench's RMSNorm kernel (torch's nn.RMSNorm is its slow twin)
        f"moe.num_experts={shape.experts}", f"moe.top_k={shape.top_k}", f"moe.expert_hidden={shape.hidden}",
        "moe.shared_expert_hidden=0", "moe.gating=softmax", "moe.norm_topk_prob=false",
        # transformers' OLMoE has the load-balancing loss (router_aux_loss_coef 0.01) and no z-loss
        "moe.lb_loss_weight=0.01", "moe.z_loss_weight=0.0",
        f"train.micro_batch_size={shape.micro_batch}", f"train.global_batch_size={shape.micro_batch}",
        f"train.warmup_steps={timing.warmup}", "train.max_warmup_steps=0",
        f"train.steps={timing.warmup + timing.steps}",
        f"train.phase_clock={str(timing.phase_clock).lower()}", "train.profile_steps=0", "train.data=random",
        "train.device=cpu",
        f"train.compile={str(compiled).lower()}",
        f"precision.mode={precision}",
    ]


def moebench_config(shape: E2EShape, precision: str = "fp32", timing: Timing | None = None) -> Config:
    """The moebench config of the e2e comparison (validated: a bad shape is one clear error)."""
    return load_config("tiny", moebench_overrides(shape, precision, timing or Timing()))


def loss_terms(lb_weight: float, z_weight: float = 0.0) -> str:
    """The training loss, named the same way for both sides."""
    terms = ["cross-entropy", *([f"{lb_weight:g} x load-balancing"] if lb_weight else []),
             *([f"{z_weight:g} x z-loss"] if z_weight else [])]
    return " + ".join(terms)


def norm_kernel(cfg: Config) -> str:
    """moebench's RMSNorm, as ``model.norm_impl`` selects it (:func:`moebench.model.norm.make_norm`)."""
    return {"recompute": "RMSNorm torch _fused_rms_norm forward, hand-written backward (model.norm_impl=recompute)",
            "torch": "torch nn.RMSNorm (model.norm_impl=torch)"}[cfg.model.norm_impl]


def moebench_kernels(cfg: Config) -> dict[str, str]:
    """What the moebench side runs besides its experts (the record's ``moe_backend``): the AdamW its
    single-process trainer builds (shapes only, on the meta device), sdpa attention
    (:class:`moebench.model.transformer.Attention`) and its loss terms."""
    with torch.device("meta"):
        params = list(Transformer(cfg).parameters())
    return {"optimizer": adamw_kernel(build_adamw(params, cfg)), "attention": "sdpa", "norm": norm_kernel(cfg),
            "loss": loss_terms(cfg.moe.lb_loss_weight, cfg.moe.z_loss_weight)}


def olmoe_config_kwargs(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of transformers' ``OlmoeConfig`` for the same model as ``cfg``.

    Raises :class:`ConfigError` for what OLMoE cannot express (dense layers, a shared expert,
    sigmoid gating, per-head QK-norm, a head_dim other than d_model / n_heads, ...), so the two
    sides never silently train different models.
    """
    m, e = cfg.model, cfg.moe
    unsupported = {
        "model.n_dense_layers": m.n_dense_layers != 0, "moe.shared_expert_hidden": e.shared_expert_hidden != 0,
        "moe.gating": e.gating != "softmax", "model.qk_norm": not m.qk_norm,
        "model.qk_norm_scope": m.qk_norm_scope != "full", "model.head_dim": m.hd * m.n_heads != m.d_model,
        "model.attention_bias": m.attention_bias, "model.sliding_window": m.sliding_window is not None,
        "model.attention_sinks": m.attention_sinks, "moe.router_bias": e.router_bias,
        "moe.expert_groups": e.expert_groups != 1, "moe.routed_scaling": e.routed_scaling != 1.0,
        "moe.swiglu_limit": e.swiglu_limit is not None, "moe.routing": e.routing != "learned",
        "moe.bias_gamma": e.bias_gamma != 0.0, "moe.z_loss_weight": e.z_loss_weight != 0.0,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: not expressible as transformers' OlmoeConfig")
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": e.expert_hidden,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "num_experts": e.num_experts, "num_experts_per_tok": e.top_k, "norm_topk_prob": e.norm_topk_prob,
        # the aux loss on, as OLMoE trains: forward with labels adds coef * load-balancing loss
        "output_router_logits": True, "router_aux_loss_coef": e.lb_loss_weight,
        "tie_word_embeddings": False, "use_cache": False,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def transformers_version() -> str | None:
    """The installed transformers' version, or None when it is not installed (nothing is imported)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from importlib.metadata import version

    return version("transformers")


def moebench_command(shape: E2EShape, precision: str, timing: Timing, compiled: bool = False) -> list[str]:
    sets = moebench_overrides(shape, precision, timing, compiled)
    return [sys.executable, "-m", "moebench.cli", "train", "--preset", "tiny",
            *[a for item in sets for a in ("--set", item)], "--json"]


def transformers_command(shape: E2EShape, precision: str, timing: Timing) -> list[str]:
    cfg = moebench_config(shape, precision, timing)
    return [sys.executable, "-m", "moebench.bench.e2e_hf", "--olmoe", json.dumps(olmoe_config_kwargs(cfg)),
            "--micro-batch", str(shape.micro_batch), "--seq-len", str(shape.seq_len), "--precision", precision,
            "--warmup", str(timing.warmup), "--steps", str(timing.steps), "--experts", timing.hf_experts,
            "--lr", str(cfg.train.lr), "--weight-decay", str(cfg.train.weight_decay),
            "--betas", str(cfg.train.beta1), str(cfg.train.beta2), "--clip", str(cfg.train.clip_grad_norm),
            "--seed", str(cfg.train.seed)]


@dataclass
class Side:
    """One competitor: a name and the command line of one of its processes for a precision."""

    name: str
    command: Callable[[str], list[str]]
    keep: tuple[str, ...] = field(default=())  # fields of its JSON line kept beside the step times
    # fields every row of this side gets as they are (what it runs, known before it starts)
    fixed: dict[str, Any] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)  # a kept field under another name in the row


def run_side(side: Side, precision: str, timeout_s: float) -> dict[str, Any]:
    """One fresh process of ``side``: its step times and kept fields, or ``{"error": why}``."""
    record, error = train_record(side.command(precision), timeout_s)
    if record is None:
        return {"error": error}
    missing = [k for k in _REQUIRED if not record.get(k)]
    if missing:
        return {"error": f"its JSON line lacks {', '.join(missing)}"}
    row = {k: record[k] for k in _REQUIRED}
    row.update({k: record.get(k) for k in side.keep})
    row.update({new: record.get(old) for old, new in side.rename.items()})
    row.update(side.fixed)
    row["tokens_per_s"] = row["tokens_per_step"] / statistics.median(row["step_times_s"])
    return row


def run_rounds(sides: Sequence[Side], precisions: Sequence[str], rounds: int, timeout_s: float,
               progress: Callable[[str], None] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``{precision: [round: {side: row}]}``: round by round, each precision in turn, each side in order,
    one fresh process each (A B A B ...)."""
    out: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}
    for r in range(rounds):
        for precision in precisions:
            row = {}
            for side in sides:
                row[side.name] = run_side(side, precision, timeout_s)
                if progress is not None:
                    progress(f"round {r + 1}/{rounds} {precision} {side.name}: {_row_text(row[side.name])}")
            out[precision].append(row)
    return out


def e2e_sides(shape: E2EShape, timing: Timing, with_transformers: bool, compiled: bool = False) -> list[Side]:
    kept = ("moe_backend", "loss_first", "loss_last", "precision", "time_breakdown_s", "breakdown_step_s")
    ours = {"fixed": moebench_kernels(moebench_config(shape, timing=timing)), "rename": {"moe_backend": "experts"}}
    sides = [Side(MOEBENCH, lambda p: moebench_command(shape, p, timing), kept, **ours)]
    if compiled:
        sides.append(Side(COMPILED, lambda p: moebench_command(shape, p, timing, compiled=True), kept, **ours))
    if with_transformers:
        sides.append(Side(TRANSFORMERS, lambda p: transformers_command(shape, p, timing), kept + KERNEL_FIELDS))
    return sides


def run_e2e(shape: E2EShape, timing: Timing, precisions: Sequence[str] = PRECISIONS,
            progress: Callable[[str], None] | None = None, compiled: bool = False) -> dict[str, Any]:
    """Every side (moebench, moebench compiled when asked, transformers when installed), every round:
    the raw result, no statistics."""
    cfg = moebench_config(shape, precisions[0], timing)  # a bad shape fails here, before any process starts
    version = transformers_version()
    sides = e2e_sides(shape, timing, version is not None, compiled)
    if version is not None:  # a shape OLMoE cannot express fails here too
        olmoe_config_kwargs(cfg)
    return {
        "shape": asdict(shape), "timing": asdict(timing), "tokens_per_step": shape.tokens_per_step,
        "transformers": version, "sides": [s.name for s in sides],
        "rounds": run_rounds(sides, precisions, timing.rounds, timing.timeout_s, progress),
    }


def side_step_runs(rounds: list[dict[str, Any]], side: str) -> list[list[float]]:
    """Each finished round's step times of ``side``: one run per fresh process."""
    return [row[side]["step_times_s"] for row in rounds if "step_times_s" in row.get(side, {})]


# the ratios at one precision, where both sides ran: (label, numerator side, denominator side)
PAIRS = (("moebench / transformers", MOEBENCH, TRANSFORMERS), ("compiled / eager", COMPILED, MOEBENCH))


@dataclass(frozen=True)
class Comparison:
    """One ratio of tokens/s the result supports: ``numerator`` over ``denominator``, each a list of
    runs' step times (the same tokens per step on both sides), measured in the same interleaved rounds."""

    label: str
    precision: str  # the precision both sides ran, or "bf16 vs fp32"
    numerator: list[list[float]]
    denominator: list[list[float]]


def comparisons(result: dict[str, Any]) -> list[Comparison]:
    """What the sides of ``result`` compare: moebench against transformers and moebench compiled
    against eager at each precision, then moebench's bf16 against its fp32 (both from the same rounds)."""
    sides, rounds = result["sides"], result["rounds"]
    out = [Comparison(label, precision, side_step_runs(rows, num), side_step_runs(rows, den))
           for label, num, den in PAIRS if num in sides and den in sides for precision, rows in rounds.items()]
    if all(p in rounds for p in PRECISIONS):
        out.append(Comparison("moebench bf16 / fp32", "bf16 vs fp32", side_step_runs(rounds["bf16"], MOEBENCH),
                              side_step_runs(rounds["fp32"], MOEBENCH)))
    return out


def kernel_lines(result: dict[str, Any]) -> list[str]:
    """What each side ran at each precision, from its first finished row: optimizer kernel and
    weight decay, attention, RMSNorm, experts implementation and loss terms."""
    lines = []
    for precision, rows in result["rounds"].items():
        for side in result["sides"]:
            row = next((r[side] for r in rows if "step_times_s" in r.get(side, {})), None)
            if row is not None:
                lines.append(f"{precision} {side}: " + "; ".join(f"{k} {row.get(k) or '?'}" for k in KERNEL_FIELDS))
    return lines


def _row_text(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    return f"{row['tokens_per_s']:,.0f} tok/s (median step {statistics.median(row['step_times_s']) * 1e3:.0f} ms)"


def format_rounds(result: dict[str, Any], precision: str) -> list[str]:
    """The per-round table of one precision: each side's tokens/s, and per round the ratios of
    :func:`comparisons` that its sides support."""
    sides = result["sides"]
    ratios = [(label, num, den) for label, num, den in PAIRS if num in sides and den in sides]
    widths = [max(len(head), 7) for head, _, _ in ratios]
    head = f"{'round':>5s} " + " ".join(f"{s + ' tok/s':>24s}" for s in sides)
    lines = [head + "".join(f" {h:>{w}s}" for (h, _, _), w in zip(ratios, widths, strict=True))]
    for i, row in enumerate(result["rounds"][precision], 1):
        cells = [f"{row[s]['tokens_per_s']:24,.0f}" if "tokens_per_s" in row[s] else f"{'failed':>24s}"
                 for s in sides]
        line = f"{i:5d} " + " ".join(cells)
        for (_, num, den), width in zip(ratios, widths, strict=True):
            both = "tokens_per_s" in row[num] and "tokens_per_s" in row[den]
            line += f" {row[num]['tokens_per_s'] / row[den]['tokens_per_s']:{width}.2f}" if both else " " * (width + 1)
        lines.append(line)
    for i, row in enumerate(result["rounds"][precision], 1):
        lines += [f"  round {i} {s}: {row[s]['error']}" for s in sides if "error" in row[s]]
    return lines


def breakdown_lines(result: dict[str, Any]) -> list[str]:
    """Where each moebench side's step goes at each precision (``--breakdown``): per phase, the median
    over rounds of the timed steps' ``time_breakdown_s``, largest first, and the step they partition."""
    lines = []
    for precision, rows in result["rounds"].items():
        for side in (s for s in result["sides"] if s != TRANSFORMERS):
            runs = [row[side] for row in rows if (row.get(side) or {}).get("time_breakdown_s")]
            if not runs:
                continue
            phases = {k: statistics.median(r["time_breakdown_s"].get(k, 0.0) for r in runs) for k in PHASES}
            parts = [f"{k} {v * 1e3:.0f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v >= 5e-4]
            step = statistics.median(r["breakdown_step_s"] for r in runs)
            lines.append(f"{precision} {side}: {', '.join(parts)} ms (timed step {step * 1e3:.0f} ms, "
                         f"median of {len(runs)} runs)")
    return lines
