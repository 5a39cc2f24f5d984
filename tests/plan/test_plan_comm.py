"""Communication bytes per axis: the counting convention, hand-computed cases, and the
mechanism the reference benchmark shows (FSDP bytes grow with experts, DDP+EP's do not)."""

from __future__ import annotations

import itertools

import pytest

from moebench.plan import comm
from moebench.plan.planner import apply_world_size, build_plan
from moebench.plan.precision import Precision
from moebench.plan.stages import stages
from moebench.presets import load_config

FP32 = Precision("fp32", 4)
BF16 = Precision("bf16", 2)


def test_collective_counting_convention():
    assert comm.all_reduce(800, 4) == 2 * 3 / 4 * 800
    assert comm.all_gather(800, 4) == 3 / 4 * 800
    assert comm.all_to_all(800, 4) == 600
    for fn in (comm.all_reduce, comm.all_gather, comm.all_to_all):
        assert fn(800, 1) == 0.0


def _axes(overrides, prec=FP32, preset="tiny", stage=0):
    cfg = load_config(preset, overrides)
    return cfg, comm.bytes_per_axis(comm.stage_comm(cfg, prec, stages(cfg)[stage]))


def test_ddp_all_reduces_every_gradient_once_per_step():
    cfg, axes = _axes(["parallel.dp=2", "train.global_batch_size=16", "train.micro_batch_size=2"])
    assert cfg.grad_accum_steps == 4  # still one all-reduce per step and buffer
    # every gradient once: the expert buffer on edp (all of dp at ep 1), as the trainer counts it
    assert axes["dp"] + axes["edp"] == 2 * 1 / 2 * 4 * cfg.total_params()
    moe_layers = cfg.model.n_layers - cfg.model.n_dense_layers
    assert axes["edp"] == 2 * 1 / 2 * 4 * cfg.moe.num_experts * cfg.expert_params() * moe_layers


def test_ddp_ep_splits_dense_and_expert_gradients():
    cfg, axes = _axes(["parallel.dp=4", "parallel.ep=2", "train.global_batch_size=16", "train.micro_batch_size=4"])
    st = stages(cfg)[0]
    assert axes["dp"] == pytest.approx(2 * 3 / 4 * 4 * st.dense_params)
    assert axes["edp"] == pytest.approx(2 * 1 / 2 * 4 * st.expert_params_local)  # dp / ep = 2 ranks
    # dispatch + combine, forward and backward, (ep-1)/ep of the rows leave; plus the count exchange
    m, e = cfg.model, cfg.moe
    tokens = cfg.train.micro_batch_size * m.seq_len
    n_moe = m.n_layers - m.n_dense_layers
    rows = 4 * tokens * e.top_k * m.d_model * 4 + 8 * e.num_experts
    assert axes["ep"] == pytest.approx(1 / 2 * rows * n_moe)


def test_mxfp8_forward_dispatch_sends_e4m3_rows_and_scales():
    base = ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", "train.micro_batch_size=4"]
    cfg, bf16 = _axes(base, BF16)
    _, mx = _axes(base, Precision("mxfp8", 2))
    m = cfg.model
    rows = cfg.train.micro_batch_size * m.seq_len * cfg.moe.top_k * (m.n_layers - m.n_dense_layers)
    # one of the four all-to-alls (the forward dispatch) goes from 2 D to D + D/32 bytes a row
    assert bf16["ep"] - mx["ep"] == pytest.approx(1 / 2 * rows * (2 * m.d_model - (m.d_model + m.d_model // 32)))


def test_dist_opt_moves_the_same_bytes_as_all_reduce():
    base = ["parallel.dp=4", "parallel.ep=2", "train.global_batch_size=16", "train.micro_batch_size=4"]
    _, plain = _axes(base)
    _, sharded = _axes([*base, "parallel.dist_opt=true"])
    assert sharded == pytest.approx(plain)


def test_fsdp_gathers_twice_and_reduce_scatters_per_chunk():
    cfg, axes = _axes(["parallel.dp=2", "parallel.strategy=fsdp", "train.global_batch_size=16",
                       "train.micro_batch_size=4"])
    st = stages(cfg)[0]
    layers = st.params_local - st.embed_head_params
    per_chunk = 4 * (2 * layers + st.embed_head_params) + 4 * st.params_local
    assert axes == {"dp": pytest.approx(1 / 2 * per_chunk * cfg.grad_accum_steps)}


def test_bf16_fsdp_gathers_norms_routers_and_embedding_in_fp32():
    """The planner's bf16 FSDP gathers against the model's own parameters, split as
    moebench.parallel.fsdp splits them (tests/parallel/test_parallel_comm.py checks the same split
    against the bytes a real run moves)."""
    from moebench.model import build_model
    from moebench.parallel.fsdp import fp32_modules

    overrides = ["parallel.dp=2", "parallel.strategy=fsdp", "train.global_batch_size=16",
                 "train.micro_batch_size=4", "model.qk_norm=true"]
    cfg, axes = _axes(overrides, BF16)
    model = build_model(cfg)
    fp32_ids = {id(p) for b in model.layers.values() for m in fp32_modules(b) for p in m.parameters()}
    layer = [p for b in model.layers.values() for p in b.parameters()]
    small = sum(p.numel() for p in layer if id(p) in fp32_ids)
    matmul = sum(p.numel() for p in layer) - small
    head = model.lm_head.weight.numel()
    root = sum(p.numel() for p in model.parameters()) - small - matmul - head  # embedding + final norm
    gathers = 2 * (2 * matmul + 4 * small) + 2 * head + 4 * root
    reduces = 4 * (matmul + small + head + root)
    assert axes == {"dp": pytest.approx(1 / 2 * (gathers + reduces) * cfg.grad_accum_steps)}


def test_rowwise_dispatcher_sends_capacity_sized_buffers():
    base = ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", "train.micro_batch_size=4"]
    _, sync = _axes(base)
    cfg, rowwise = _axes([*base, "parallel.dispatcher=rowwise"])
    counts_sync = 1 / 2 * 8 * cfg.moe.num_experts * cfg.model.n_layers
    counts_rowwise = 1 / 2 * 8 * cfg.moe.num_experts * 2 * cfg.model.n_layers
    # receive-side capacity: each of the ep blocks can take a destination's whole capacity,
    # min(1, 1.25) x all the rank's routes
    assert rowwise["ep"] - counts_rowwise == pytest.approx(2 * (sync["ep"] - counts_sync))
    _, pair = _axes([*base, "parallel.dispatcher=rowwise", "parallel.rowwise_capacity=pair"])
    assert pair["ep"] - counts_rowwise == pytest.approx(1.25 * (sync["ep"] - counts_sync))


def test_lossless_capacity_sends_blocks_of_all_routes():
    """moe.capacity=lossless: capacity factor ep = 2 (capacity_factor 0.5 ignored), so under
    either rule each of the ep blocks holds all of a rank's routes: ep x the exact rows."""
    base = ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", "train.micro_batch_size=4"]
    _, sync = _axes(base)
    cfg, _ = _axes([*base, "parallel.dispatcher=rowwise"])
    counts_sync = 1 / 2 * 8 * cfg.moe.num_experts * cfg.model.n_layers
    counts_rowwise = 1 / 2 * 8 * cfg.moe.num_experts * 2 * cfg.model.n_layers
    for rule in ("destination", "pair"):
        _, lossless = _axes([*base, "parallel.dispatcher=rowwise", "moe.capacity=lossless", "moe.capacity_factor=0.5",
                             f"parallel.rowwise_capacity={rule}"])
        assert lossless["ep"] - counts_rowwise == pytest.approx(2 * (sync["ep"] - counts_sync)), rule


def _split(overrides: list[str]) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    plan = build_plan(load_config("tiny", overrides), "h200")
    return plan["comm_bytes_per_step"], plan["comm_bytes_valid"], plan["comm_bytes_padding"]


@pytest.mark.parametrize(("extra", "padded_rows"), [
    ([], 0.0),  # the sync dispatcher sends exact rows
    (["parallel.dispatcher=rowwise"], 1 - 1 / 2),  # destination blocks of the whole capacity: 2 x the routes
    (["parallel.dispatcher=rowwise", "parallel.rowwise_capacity=pair"], 1 - 1 / 1.25),  # 1.25 x the share
    (["parallel.dispatcher=rowwise", "parallel.rowwise_capacity=pair", "moe.capacity_factor=0.5"], 0.0),  # drops
])
def test_padding_is_the_empty_share_of_the_rowwise_blocks(extra, padded_rows):
    """``comm_bytes_padding`` is the empty slots' share of the dispatch rows (routing balanced, as
    the plan takes it), the count exchange none of it; ``comm_bytes_valid`` the rest."""
    base = ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", "train.micro_batch_size=4"]
    total, valid, padding = _split([*base, *extra])
    cfg = load_config("tiny", [*base, *extra])
    counts = 1 / 2 * 8 * cfg.moe.num_experts * (2 if extra else 1) * cfg.model.n_layers
    assert padding["dp"] == 0.0 and valid["dp"] == total["dp"]
    assert padding["ep"] == pytest.approx(padded_rows * (total["ep"] - counts))
    assert valid["ep"] + padding["ep"] == pytest.approx(total["ep"])


def test_pipeline_sends_hidden_states_forward_and_gradients_back():
    base = ["parallel.pp=4", "model.n_layers=4", "train.global_batch_size=8", "train.micro_batch_size=4",
            "parallel.pp_microbatches=2"]
    cfg = load_config("tiny", base)
    sent = [comm.bytes_per_axis(comm.stage_comm(cfg, BF16, s)).get("pp", 0.0) for s in stages(cfg)]
    one_way = 4 * cfg.tokens_per_step * cfg.model.d_model  # fp32 residual stream, every token once
    assert sent == pytest.approx([one_way, 2 * one_way, 2 * one_way, one_way])
    # interleaved: rank r also runs virtual stage r + pp; only the two pipeline ends send one way
    cfg = load_config("tiny", [*base, "parallel.pp_schedule=interleaved-1f1b"])
    sent = [comm.bytes_per_axis(comm.stage_comm(cfg, BF16, s)).get("pp", 0.0) for s in stages(cfg)]
    assert sent == pytest.approx([3 * one_way, 4 * one_way, 4 * one_way, 3 * one_way])
    # four virtual stages a rank (8 layers): each sends both ways but the two pipeline ends
    cfg = load_config("tiny", [*base, "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=4",
                               "model.n_layers=16"])
    sent = [comm.bytes_per_axis(comm.stage_comm(cfg, BF16, s)).get("pp", 0.0) for s in stages(cfg)]
    assert sent == pytest.approx([7 * one_way, 8 * one_way, 8 * one_way, 7 * one_way])


def test_virtual_stages_and_uneven_layouts_set_each_ranks_layers():
    """A rank's stage holds the layers of all its virtual stages (r, r + pp, ...), as parallel.pp_layers gives."""
    base = ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "model.n_layers=9", "model.n_dense_layers=2"]
    cfg = load_config("tiny", [*base, "parallel.pp_virtual_stages=4", "parallel.pp_layers=1,2,1,1,1,1,1,1"])
    got = [(s.n_dense, s.n_moe, s.has_embed, s.has_head) for s in stages(cfg)]
    # rank 0: layers 0, 3, 5, 7 (one dense); rank 1: 1-2, 4, 6, 8 (layer 1 dense)
    assert got == [(1, 3, True, False), (1, 4, False, True)]
    two = load_config("tiny", base)  # 2 virtual: 3, 2, 2, 2 layers, rank 0 holds stages 0 and 2
    assert [(s.n_dense, s.n_moe) for s in stages(two)] == [(2, 3), (0, 4)]


def test_recompute_repeats_the_forward_all_to_alls():
    base = ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", "train.micro_batch_size=4"]
    cfg, plain = _axes(base)
    _, recompute = _axes([*base, "parallel.activation_checkpointing=per-layer"])
    counts = 1 / 2 * 8 * cfg.moe.num_experts * cfg.model.n_layers
    assert recompute["ep"] - 2 * counts == pytest.approx(1.5 * (plain["ep"] - counts))


def _family_plan(experts: int, strategy: str) -> dict:
    overrides = [f"parallel.strategy={strategy}"] + (["parallel.ep=8"] if strategy == "ddp" else [])
    cfg = apply_world_size(load_config(f"moe-8l-e{experts}", overrides), 8, dp_given=False, batch_given=False)
    return build_plan(cfg, "b300")


def test_fsdp_bytes_grow_with_experts_ddp_ep_bytes_do_not():
    family = (8, 32, 48, 64, 128)
    fsdp = [sum(_family_plan(e, "fsdp")["comm_bytes_per_step"].values()) for e in family]
    ddp = [sum(_family_plan(e, "ddp")["comm_bytes_per_step"].values()) for e in family]
    assert all(b > a for a, b in itertools.pairwise(fsdp))
    assert fsdp[-1] / fsdp[0] > 5  # 4.6B -> 47B total parameters travel
    # DDP+EP: tokens travel, weights stay; only the router (d_model x E) grows with E
    assert max(ddp) / min(ddp) < 1.01
    assert _family_plan(8, "ddp")["comm_bytes_per_step"].keys() == {"dp", "ep"}  # dp == ep: no EDP group
    # and the roofline turns that into throughput: FSDP falls behind as experts grow
    fsdp_tps = [_family_plan(e, "fsdp")["tokens_per_s_per_device"] for e in (8, 128)]
    ddp_tps = [_family_plan(e, "ddp")["tokens_per_s_per_device"] for e in (8, 128)]
    assert fsdp_tps[1] < 0.5 * fsdp_tps[0]
    assert ddp_tps[1] > 0.9 * ddp_tps[0]



@pytest.mark.parametrize("overrides", [
    ["parallel.dp=2", "parallel.strategy=fsdp"],
    ["parallel.dp=4", "parallel.ep=2", "parallel.dist_opt=true", "train.global_batch_size=32"],
    ["parallel.dp=2", "parallel.pp=2", "parallel.ep=2", "train.global_batch_size=8", "train.micro_batch_size=4"],
])
def test_every_term_names_its_collective_and_the_phases_the_trainer_counts_it_in(overrides):
    """The phase clock puts gathers in param_gather, reductions in grad_reduce (FSDP's
    reduce-scatters too), the EP all-to-alls in dispatch and combine, pipeline sends in the bubble."""
    cfg = load_config("tiny", overrides)
    seen = set()
    for st in stages(cfg):
        for t in comm.stage_comm(cfg, FP32, st):
            assert t.op in comm.OPS and t.what.endswith((t.op, f"{t.op} (fwd + bwd)")), t
            if t.axis == "ep":
                assert t.phases == ("dispatch", "combine") and t.op == "all-to-all"
            elif t.axis == "pp":
                assert t.phases == ("pipeline_bubble",) and t.op == "send"
            else:
                assert t.phases == (("param_gather",) if t.op == "all-gather" else ("grad_reduce",)), t
            seen |= set(t.phases)
    assert "grad_reduce" in seen
