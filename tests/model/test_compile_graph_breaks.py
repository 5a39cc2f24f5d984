"""A compiled MoE block is one graph: the expert kernels and the row-wise dispatcher trace (custom
ops, functional collectives), and the compiled block computes the eager math, forward and
gradients.

Graph breaks are counted twice: ``torch._dynamo.explain`` on the forward (what dynamo records,
autograd functions' backward included), and dynamo's ``graph_break`` counters after a compiled
forward and backward. The sync dispatcher is left out on purpose: its split sizes are host
values by design (one device->host copy per layer), so it runs eagerly between two graphs.

The blocks compile with the ``aot_eager`` backend: dynamo and AOTAutograd trace the forward and
the joint backward through the ops' fake implementations and registered autograd formulas, which
is where a graph breaks or a custom op goes wrong; inductor's C++ builds would take minutes on a
loaded 2-core machine, and its numerics on whole models are tests/model/test_compile.py's. Tolerances:
fp32 1e-5 relative (decompositions reorder a few reductions: last-bit differences); bf16 2e-2 of
each tensor's largest entry (8 mantissa bits, eps 7.8e-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moebench.model.experts import Experts
from moebench.model.moe import MoE
from moebench.model.phases import PhaseClock, clock_active
from moebench.parallel.comm import COUNTER
from moebench.presets import load_config
from moebench.testing import run_distributed

pytestmark = pytest.mark.slow


def _block(backend: str, local_experts_of: int = 1) -> MoE:
    cfg = load_config("tiny", [f"moe.backend={backend}"])
    torch.manual_seed(0)
    moe = MoE(cfg.model.d_model, cfg.moe)
    if local_experts_of > 1:  # this rank's share of the experts, as expert parallelism leaves them
        moe.experts = Experts(cfg.moe.num_experts // local_experts_of, cfg.model.d_model, cfg.moe.expert_hidden,
                              backend)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return moe


def _graph_breaks(moe: MoE, x: torch.Tensor) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(moe.forward)(x).graph_break_count


def _step(forward, moe: MoE, x0: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x0.clone().requires_grad_(True)
    out = forward(x)
    out.backward(grad_out)
    return {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


def _compiled_matches_eager(moe: MoE, x0: torch.Tensor, tol: dict) -> tuple[dict, dict]:
    """One compiled forward+backward against eager on a copy, with no graph break on the way;
    returns the communication bytes each counted (eager, compiled)."""
    group = getattr(moe.dispatcher, "group", None)
    eager = copy.deepcopy(moe, {id(group): group})  # a process group is shared, not copied
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1)).to(x0.dtype)
    COUNTER.reset()
    want = _step(eager.forward, eager, x0, grad_out)
    eager_bytes = COUNTER.snapshot()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    COUNTER.reset()
    got = _step(torch.compile(moe.forward, backend=BACKEND), moe, x0, grad_out)
    compiled_bytes = COUNTER.snapshot()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert got.keys() == want.keys()
    for key, ref in want.items():
        scale = ref.abs().max().item() if "scaled" in tol else 1.0
        torch.testing.assert_close(got[key], ref, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=key)
    return eager_bytes, compiled_bytes


BACKEND = "aot_eager"
FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2, "scaled": True}


def test_cpu_fused_block_is_one_graph_and_matches_eager():
    moe = _block("cpu_fused")  # single device: the fused gather + experts + combine op
    x0 = torch.randn(2, 16, 64)  # tiny: d_model 64
    assert _graph_breaks(moe, x0) == 0
    _compiled_matches_eager(moe, x0, FP32)


def test_a_step_clock_leaves_the_block_one_graph():
    """The timed steps' step clock changes nothing it times: with one active the compiled block
    still has no graph break (its phase marks are traced away); a profiling clock, which times each
    region as its own graph, breaks it (the control that shows the count can move)."""
    moe = _block("cpu_fused")
    x0 = torch.randn(2, 16, 64)
    with clock_active(PhaseClock(torch.device("cpu"))):
        assert _graph_breaks(moe, x0) == 0
    with clock_active(PhaseClock(torch.device("cpu"), profiling=True)):
        assert _graph_breaks(moe, x0) > 0


def test_grouped_mm_bf16_block_is_one_graph_and_matches_eager():
    moe = _block("grouped_mm").to(torch.bfloat16)
    x0 = torch.randn(2, 16, 64).to(torch.bfloat16)
    assert _graph_breaks(moe, x0) == 0
    _compiled_matches_eager(moe, x0, BF16)


def _rowwise_rank(backend: str) -> None:
    from moebench.parallel.dispatch import RowwiseDispatch
    from moebench.train.distributed import init_process_group

    init_process_group("cpu")
    try:
        ranks = dist.get_world_size()
        moe = _block(backend, local_experts_of=ranks)
        moe.dispatcher = RowwiseDispatch(dist.group.WORLD, moe.cfg.num_experts, capacity_factor=1.0)
        x0 = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
        assert _graph_breaks(moe, x0) == 0
        with clock_active(PhaseClock(torch.device("cpu"))):  # a timed step's clock: still one graph
            assert _graph_breaks(moe, x0) == 0
        eager_bytes, compiled_bytes = _compiled_matches_eager(moe, x0, FP32)
        # the compiled block counts its all-to-alls (and their backward) as the eager one does
        assert compiled_bytes == eager_bytes and eager_bytes["ep"] > 0
    finally:
        dist.destroy_process_group()


def test_rowwise_dispatch_block_is_one_graph_on_two_ranks():
    """fp32 ``grouped_mm`` experts (the ``moebench::grouped_mm`` op) behind the row-wise
    dispatcher, 2 gloo ranks: collectives, keep-matrix and counters all inside one graph."""
    run_distributed(_rowwise_rank, 2, "grouped_mm", timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels compile for a GPU)")
def test_triton_block_is_one_graph_and_matches_eager():
    """The ``triton`` backend's grouped GEMMs are ``torch.library.triton_op``s: dynamo traces the
    kernel launches (``wrap_triton``) instead of breaking the graph around them. On CPU the
    interpreter runs kernels even on fake tensors, so this needs a GPU."""
    pytest.importorskip("triton")
    moe = _block("triton").cuda().to(torch.bfloat16)
    x0 = torch.randn(2, 16, 64, device="cuda").to(torch.bfloat16)
    assert _graph_breaks(moe, x0) == 0
    _compiled_matches_eager(moe, x0, BF16)
