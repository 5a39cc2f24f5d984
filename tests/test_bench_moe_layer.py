"""``moebench bench moe-layer``: every row runs, and the rows the ratios compare do the same GEMM FLOPs
(counted by torch's FlopCounterMode, not by our formula)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode

from moebench.bench.moe_layer import LayerShape, _dense_case, _expert_gemms_case, run_benchmark
from moebench.cli import cli

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
    assert set(data["results"]) == {"dense_matmul", "dense_swiglu_mlp", "expert_gemms", "moe_grouped_mm",
                                    "moe_cpu_fused", "moe_masked_loop", "moe_loop_backend"}
    assert data["results"]["dense_matmul"]["ratio_to_dense"] == 1.0


def test_interleaved_rounds_keep_every_sample():
    out = run_benchmark(SHAPE, repeats=3, warmup=1, include_loop=False)
    assert all(len(row["samples_s"]) == 3 for row in out["results"].values())
