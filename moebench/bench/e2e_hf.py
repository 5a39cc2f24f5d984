"""The transformers side of ``moebench bench e2e``: the training loop a user would write with
``OlmoeForCausalLM``, in one process, printing one JSON line (``step_times_s`` and friends).

The loop is the plain one: ``model.train()``, forward with ``labels`` (transformers shifts them and
adds ``router_aux_loss_coef`` x its load-balancing loss, as OLMoE trains), ``loss.backward()``, the
gradient clip moebench also applies, ``optimizer.step()``, ``zero_grad()``. The optimizer is the
fastest AdamW torch offers a user on CPU, ``fused=True`` (``foreach=True`` on a torch without a
fused CPU kernel), with moebench's weight-decay rule
(matrices only: :func:`moebench.parallel.optimizer.adamw`, the one moebench's trainer builds), so
the comparison times the models and their kernels, not two optimizer settings. bf16 is autocast around
the forward with fp32 weights, as moebench's bf16 mode is. Each step's tokens are drawn before its
timer starts, as moebench's trainer draws its batch before its own.

Run by :mod:`moebench.bench.e2e`; ``python -m moebench.bench.e2e_hf --help`` for its options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from moebench.bench.e2e import HF_EXPERTS, loss_terms
from moebench.metrics.op_account import CLIP_RANGE
from moebench.metrics.timer import time_call
from moebench.parallel.optimizer import adamw, adamw_kernel, fused_adamw_supported

CPU = torch.device("cpu")  # the end-to-end comparison runs on CPU


def build_model(olmoe_kwargs: dict[str, Any], experts: str, seed: int) -> torch.nn.Module:
    """``OlmoeForCausalLM`` from :func:`moebench.bench.e2e.olmoe_config_kwargs`, fp32, sdpa attention."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    return OlmoeForCausalLM(OlmoeConfig(**olmoe_kwargs, attn_implementation="sdpa", experts_implementation=experts))


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """The transformers side's AdamW: torch's fastest kernel on CPU (fused where torch has one, else
    foreach), decay on matrices only, as moebench's trainer builds it."""
    fused = fused_adamw_supported(CPU)
    return adamw(model.parameters(), args.lr, tuple(args.betas), args.weight_decay, fused=fused, foreach=not fused)


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
                  losses: list[float]) -> Callable[[torch.Tensor], None]:
    """The training step, a function of a batch of token ids (``model`` put in training mode): forward with
    labels, backward, clip, AdamW, ``zero_grad``; each step's loss is appended to ``losses``."""
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16" \
        else contextlib.nullcontext
    model.train()

    def step(input_ids: torch.Tensor) -> None:
        with autocast():
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if args.clip > 0:
            with torch.profiler.record_function(CLIP_RANGE):  # named for a profile's account
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the loss a user logs each step

    return step


def train(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    model = build_model(json.loads(args.olmoe), args.experts, args.seed)
    vocab = model.config.vocab_size
    optimizer = build_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    step = training_step(model, optimizer, args, losses)
    times: list[float] = []
    for i in range(args.warmup + args.steps):
        input_ids = torch.randint(vocab, (args.micro_batch, args.seq_len), generator=gen)
        elapsed = time_call(lambda ids=input_ids: step(ids), CPU)
        if i >= args.warmup:
            times.append(elapsed)
    tokens = args.micro_batch * args.seq_len
    return {
        "status": "ok", "step_times_s": times, "tokens_per_step": tokens,
        "tokens_per_s": tokens / statistics.median(times), "loss_first": losses[0], "loss_last": losses[-1],
        "precision": args.precision, "moe_backend": f"transformers {args.experts}",
        "params": sum(p.numel() for p in model.parameters()), "transformers": transformers.__version__,
        "optimizer": adamw_kernel(optimizer), "attention": model.config._attn_implementation,
        "norm": f"{type(model.model.norm).__name__} (torch ops)",
        "experts": args.experts, "loss": loss_terms(model.config.router_aux_loss_coef),
        "threads": torch.get_num_threads(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m moebench.bench.e2e_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--olmoe", required=True, help="OlmoeConfig keyword arguments as a JSON object")
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", choices=HF_EXPERTS, default="grouped_mm",
                        help="transformers' experts_implementation")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(train(parse_args(argv))))


if __name__ == "__main__":
    main()
