"""Every parallel layout computes the single-process math: losses over 3 steps, the run
record's router statistics and the final weights match a one-process run on the same
global batch.

Tolerance (fp32): layouts differ only in summation order (gradient all-reduce, the
all-to-all's reordering, sharded vs whole-tensor norms). Adam divides by sqrt(v), which
amplifies relative noise on tiny gradients, so weights get rtol 2e-4 / atol 2e-5
(lr is 1e-3; a real bug moves weights by ~lr).
"""

import pytest
import torch
from parity_helpers import BASE, assert_router_stats_match, train_and_save
from torch import nn

from moebench.model.router import Router
from moebench.presets import load_config
from moebench.testing import run_distributed
from moebench.train.run import run_training

pytestmark = pytest.mark.slow  # every test here starts ranks (run_distributed)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "ref.pt")
    train_and_save([], path)
    return torch.load(path)


LAYOUTS = {
    "fsdp": (2, ["parallel.strategy=fsdp", "parallel.dp=2"]),
    "ddp": (2, ["parallel.dp=2"]),
    "ddp-distopt": (2, ["parallel.dp=2", "parallel.dist_opt=true"]),
    "ddp-ep2-sync": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=sync"]),
    "ddp-ep2-rowwise": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise",
                            "moe.capacity_factor=2.0"]),
    "ddp-ep2-rowwise-distopt-dp4": (4, ["parallel.dp=4", "parallel.ep=2", "parallel.dispatcher=rowwise",
                                        "moe.capacity_factor=2.0", "parallel.dist_opt=true"]),
    "ddp-ep2-sync-distopt": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.dist_opt=true"]),
    "fsdp-ep2": (4, ["parallel.strategy=fsdp", "parallel.dp=4", "parallel.ep=2"]),
    "ddp-ep2-rowwise-recompute": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise",
                                      "moe.capacity_factor=2.0", "parallel.activation_checkpointing=per-layer"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    world, overrides = LAYOUTS[name]
    path = str(tmp_path / "run.pt")
    run_distributed(train_and_save, world, overrides, path)
    got = torch.load(path)
    assert got["record"]["world_size"] == world
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)
    assert_router_stats_match(got["record"], reference["record"], name)
    assert got["state"].keys() == reference["state"].keys()
    for key, ref in reference["state"].items():
        torch.testing.assert_close(got["state"][key], ref, rtol=2e-4, atol=2e-5, msg=f"{name}: {key}")


def _record(overrides: list[str]) -> dict:
    return run_training(load_config("tiny", BASE + overrides))


def test_record_statistics_cover_every_dp_rank(reference):
    """Fast: the run record's loss curve, lb/z losses and expert load under dp=2 (with EP)
    are the whole global batch's on every rank, as in the single-process run."""
    records = run_distributed(_record, 2, LAYOUTS["ddp-ep2-rowwise"][1])
    for rank, got in enumerate(records):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert_router_stats_match(got, reference["record"], f"rank {rank}")


def test_dropped_routes_are_counted_once_over_ranks():
    """Uniform routing makes the drops a function of shapes only. Per layer and micro-batch
    a rank routes 2 sequences x 64 tokens x top-2 = 256 routes, 128 to each of the 2 EP
    ranks; capacity 0.5 lets a destination receive 2 * ceil(0.5 * 256 / 2) = 128 of the 256
    routes sent to it, 64 from each source (max-min fair), so each rank drops 128.
    Over 2 timed steps x 2 layers x 2 micro-batches x 2 ranks: 2048 (rank 0 alone: 1024;
    counted by sender and receiver: 4096)."""
    records = run_distributed(_record, 2, ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise",
                                           "moe.capacity_factor=0.5", "moe.routing=uniform"])
    assert [r["dropped_tokens"] for r in records] == [2048, 2048]


def test_lossless_capacity_drops_no_route():
    """Learned routing at capacity factor 0.5 drops routes; moe.capacity=lossless ignores that
    factor (the worst case, ep = 2: every route of both sources fits one destination) and drops none."""
    rowwise = ["parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise", "moe.capacity_factor=0.5"]
    assert all(r["dropped_tokens"] > 0 for r in run_distributed(_record, 2, rowwise)), "setup: 0.5 must drop"
    for rule in ("destination", "pair"):
        records = run_distributed(_record, 2, [*rowwise, "moe.capacity=lossless", f"parallel.rowwise_capacity={rule}"])
        assert [r["dropped_tokens"] for r in records] == [0, 0], rule


@pytest.fixture(scope="module")
def reference_mb1(tmp_path_factory):
    """The pipeline splits each 2-sequence micro-batch into 2 chunks, and the load-balancing
    loss is not additive over tokens (it multiplies two batch means), so the matching
    single-process run uses 1-sequence micro-batches.

    The aux-loss-free bias is off here: other chunk shapes change GEMM blocking, so logits
    differ in the last bit, which can flip a near-tie in top-k and hence a count in the
    sign() of the bias update: a discrete amplifier of rounding, not a difference in math.
    """
    cache: dict[int, dict] = {}

    def get(n_layers: int) -> dict:
        if n_layers not in cache:
            path = str(tmp_path_factory.mktemp("ref1") / "ref.pt")
            train_and_save(["train.micro_batch_size=1", "moe.bias_gamma=0", f"model.n_layers={n_layers}"], path)
            cache[n_layers] = torch.load(path)
        return cache[n_layers]

    return get


PIPELINE_LAYOUTS = {
    "pp2-1f1b": (2, ["parallel.pp=2"]),
    "pp2-gpipe": (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    # 4 layers: two virtual stages of one layer on each of the 2 ranks
    "pp2-interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "model.n_layers=4"]),
    # 8 layers: four virtual stages of one layer on each of the 2 ranks (stages 0, 2, 4, 6 on rank 0)
    "pp2-interleaved-v4": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b",
                               "parallel.pp_virtual_stages=4", "model.n_layers=8"]),
    # an uneven layout the default split would not give (it puts the extra layer first): the last stage
    # holds two layers and the LM head
    "pp2-interleaved-uneven": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b",
                                   "parallel.pp_layers=1,1,1,2", "model.n_layers=5"]),
    "pp2-ep2-rowwise": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.dispatcher=rowwise",
                            "moe.capacity_factor=2.0"]),
    "pp2-ep2-sync-distopt": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.dist_opt=true"]),
    # FSDP2 per stage: each stage's blocks sharded over its dp replicas, torch's PipelineStage
    # holding back the reduce-scatters until a step's last chunk
    "pp2-fsdp": (2, ["parallel.pp=2", "parallel.strategy=fsdp"]),
    "pp2-fsdp-dp2": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.strategy=fsdp"]),
}


@pytest.mark.parametrize("name", list(PIPELINE_LAYOUTS))
def test_pipeline_matches_single_process(name, reference_mb1, tmp_path):
    world, overrides = PIPELINE_LAYOUTS[name]
    layers = [int(o.split("=")[1]) for o in overrides if o.startswith("model.n_layers=")]
    reference = reference_mb1(layers[0] if layers else 2)
    path = str(tmp_path / "run.pt")
    run_distributed(train_and_save, world, [*overrides, "parallel.pp_microbatches=2", "moe.bias_gamma=0"], path)
    got = torch.load(path)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)
    # router statistics cover every stage's layers and every dp replica, not only rank 0's,
    # and step 0 does not count the forward torch's PipelineStage runs to infer shapes
    assert_router_stats_match(got["record"], reference["record"], name)
    assert got["state"].keys() == reference["state"].keys()
    for key, ref in reference["state"].items():
        torch.testing.assert_close(got["state"][key], ref, rtol=2e-4, atol=2e-5, msg=f"{name}: {key}")


def test_uneven_pipeline_split(reference_mb1, tmp_path):
    """3 layers on 2 stages (2 + 1), as 63 layers go on 8 stages."""
    path = str(tmp_path / "run.pt")
    run_distributed(train_and_save, 2, ["parallel.pp=2", "model.n_layers=3", "parallel.pp_microbatches=2",
                                "moe.bias_gamma=0"], path)
    got, reference = torch.load(path), reference_mb1(3)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)
    for key, ref in reference["state"].items():
        torch.testing.assert_close(got["state"][key], ref, rtol=2e-4, atol=2e-5, msg=key)


FULL_QK = ["model.qk_norm=true", "model.qk_norm_scope=full"]


@pytest.mark.parametrize("name", ["fsdp", "ddp-ep2-sync"])
def test_full_qk_norm_matches_single_process(name, tmp_path):
    """Full-width q/k norm weights are dense parameters like any other: FSDP shards them, DDP
    reduces them; the math stays the single process's."""
    ref_path, path = str(tmp_path / "ref.pt"), str(tmp_path / "run.pt")
    train_and_save(FULL_QK, ref_path)
    world, overrides = LAYOUTS[name]
    run_distributed(train_and_save, world, [*overrides, *FULL_QK], path)
    ref, got = torch.load(ref_path), torch.load(path)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    assert ref["state"]["layers.0.attn.q_norm.weight"].shape == (64,)  # n_heads x head_dim of tiny
    for key, want in ref["state"].items():
        torch.testing.assert_close(got["state"][key], want, rtol=2e-4, atol=2e-5, msg=f"{name}: {key}")


# the weight each kind of module computes with (the router calls F.linear on its gate's weight)
WEIGHT_OF = {nn.RMSNorm: lambda m: m.weight, Router: lambda m: m.gate.weight, nn.Linear: lambda m: m.weight}


def _train_seeing_weight_dtypes(overrides: list[str], out_path: str) -> list[tuple[str, str]]:
    """``train_and_save``, returning the dtype of the weight each kind of module computed with,
    read after every forward (FSDP2 reshards in a post-forward hook of its own, which runs after
    the global ones: the weights are still gathered then)."""
    seen = set()

    def record(module: nn.Module, args: tuple, out: object) -> None:
        for kind, weight in WEIGHT_OF.items():
            if isinstance(module, kind):
                seen.add((kind.__name__, str(weight(module).dtype)))

    handle = nn.modules.module.register_module_forward_hook(record)
    try:
        train_and_save(overrides, out_path)
    finally:
        handle.remove()
    return sorted(seen)


def test_bf16_fsdp_computes_what_one_bf16_process_computes(tmp_path):
    """Under bf16 FSDP gathers matmul weights in bf16 (the values autocast gives them anyway) but
    keeps the embedding, the norms (q/k norms included) and the routers in fp32, and the residual
    stream uncast, as one process (and ddp) computes: the losses match to fp32 tolerance.

    The weights get a bf16 tolerance on each tensor's relative norm of difference. Measured with
    q/k norms on (python over this test's runs): 1.3% of the elements differ beyond the fp32
    tolerance, by up to half a learning-rate step (Adam magnifies a near-zero gradient whose bf16
    rounding differs), worst tensor 1.2e-3 of its norm; ddp is within fp32 tolerance everywhere.
    Gathering every parameter in bf16 (the previous policy) moves the loss by 7.8e-5 and 58% of
    the elements, worst tensor 3.0e-2 of its norm: 6x over the 5e-3 bound; the norms and routers
    alone gathered in bf16 give 6.7e-3, under 6x the measured 1.2e-3, so the test also reads the
    dtype each module's weight had in the forward: fp32 for norms and routers, bf16 for the
    matmuls (proof the bf16 gather is in force)."""
    bf16 = ["precision.mode=bf16", "model.qk_norm=true"]
    ref_path, path = str(tmp_path / "ref.pt"), str(tmp_path / "run.pt")
    train_and_save(bf16, ref_path)
    world, overrides = LAYOUTS["fsdp"]
    seen = run_distributed(_train_seeing_weight_dtypes, world, [*overrides, *bf16], path)
    ref, got = torch.load(ref_path), torch.load(path)
    assert got["record"]["precision"] == "bf16"
    for rank_seen in seen:
        assert rank_seen == [("Linear", "torch.bfloat16"), ("RMSNorm", "torch.float32"), ("Router", "torch.float32")]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for key, want in ref["state"].items():
        rel = ((got["state"][key] - want).norm() / want.norm()).item()
        assert rel < 5e-3, f"bf16 fsdp: {key} differs from one bf16 process by {rel:.1e} of its norm"
