"""``moebench bench moe-layer``: every row runs, and the rows the ratios compare do the same GEMM FLOPs
(counted by torch's FlopCounterMode, not by our formula)."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from moebench.bench import moe_layer
from moebench.bench.moe_layer import LayerShape, _dense_case, _expert_gemms_case, run_benchmark
from moebench.cli import cli
from moebench.model.moe import MoE

SHAPE = LayerShape(tokens=24, d_model=16, hidden=8, experts=5, top_k=2)  # 48 routes: groups of 10 and 9


@pytest.mark.parametrize("case", [lambda: _dense_case(SHAPE, torch.float32, with_swiglu=False),
                                  lambda: _expert_gemms_case(SHAPE, torch.float32)], ids=["dense", "expert_gemms"])
def test_reference_rows_do_the_expert_flops(case):
    run = case()
    with FlopCounterMode(display=False) as counter:
        run()
    assert counter.get_total_flops() == SHAPE.expert_flops


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cli_runs_every_row(dtype):
    result = CliRunner().invoke(cli, ["bench", "moe-layer", "--tokens", "24", "--d-model", "16", "--hidden", "8",
                                      "--experts", "5", "--top-k", "2", "--repeats", "1", "--dtype", dtype, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    extra = {"moe_cpu_fused_block_bf16"} if dtype == "bf16" else set()  # the labelled whole-block-bf16 row
    assert set(data["results"]) == {"dense_matmul", "dense_swiglu_mlp", "expert_gemms", "moe_grouped_mm",
                                    "moe_cpu_fused", "moe_masked_loop", "moe_loop_backend"} | extra
    assert ("autocast" in data["precision_path"]) == (dtype == "bf16")
    assert data["results"]["dense_matmul"]["ratio_to_dense"] == 1.0


def test_interleaved_rounds_keep_every_sample():
    out = run_benchmark(SHAPE, repeats=3, warmup=1, include_loop=False)
    assert all(len(row["samples_s"]) == 3 for row in out["results"].values())


class _Watched(MoE):
    """An MoE block that records how each forward holds and computes: its weights' dtype, its input's,
    autocast's state, and after backward its weight gradients' dtype."""

    seen: ClassVar[list[dict]] = []

    def forward(self, x):
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
        self.seen.append({"weights": self.experts.w13.dtype, "rows": x.dtype, "autocast": autocast})
        out = super().forward(x)
        self.experts.w13.register_post_accumulate_grad_hook(
            lambda p: self.seen[-1].__setitem__("grads", p.grad.dtype))
        return out


@pytest.mark.parametrize("backend", ["cpu_fused", "grouped_mm", "loop"])
def test_bf16_rows_run_the_training_precision_path(monkeypatch, backend):
    """As precision.mode=bf16 trains: fp32 master weights and rows, bf16 autocast, fp32 weight gradients;
    the whole-block-bf16 form only in its labelled row."""
    monkeypatch.setattr(moe_layer, "MoE", _Watched)
    _Watched.seen = []
    moe_layer._moe_case(SHAPE, backend, torch.bfloat16)()
    assert _Watched.seen == [{"weights": torch.float32, "rows": torch.float32, "autocast": torch.bfloat16,
                              "grads": torch.float32}]
    _Watched.seen = []
    moe_layer._moe_case(SHAPE, backend, torch.bfloat16, block_dtype=True)()
    assert _Watched.seen == [{"weights": torch.bfloat16, "rows": torch.bfloat16, "autocast": False,
                              "grads": torch.bfloat16}]
    _Watched.seen = []
    moe_layer._moe_case(SHAPE, backend, torch.float32)()
    assert _Watched.seen == [{"weights": torch.float32, "rows": torch.float32, "autocast": False,
                              "grads": torch.float32}]


def test_masked_loop_row_runs_under_autocast_too(monkeypatch):
    calls = []
    real = moe_layer.masked_expert_loop

    def watched(x_TD, idx_TK, weight_TK, w13, w2):
        calls.append((w13.dtype, torch.is_autocast_enabled("cpu")))
        return real(x_TD, idx_TK, weight_TK, w13, w2)

    monkeypatch.setattr(moe_layer, "masked_expert_loop", watched)
    moe_layer._masked_loop_case(SHAPE, torch.bfloat16)()
    assert calls == [(torch.float32, True)]
