"""``moebench bench e2e``: fresh processes interleaved round by round (with fake competitors, so no
transformers and no training here), the ratio from the statistics module, and the shape mapping
from a moebench config to transformers' OlmoeConfig."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from moebench.bench import e2e
from moebench.cli import cli
from moebench.errors import ConfigError
from moebench.results.stats import rate_ratio

# a fake competitor: logs "name precision pid" to a file, then prints the JSON line a side prints
FAKE = """
import json, os, sys
name, precision, step, log = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
with open(log, "a") as fh:
    fh.write(f"{name} {precision} {os.getpid()}\\n")
if step < 0:
    sys.exit("boom")
times = [step * (1 + 0.01 * (i % 3)) for i in range(8)]
print(json.dumps({"status": "ok", "step_times_s": times, "tokens_per_step": 100, "loss_last": 1.0}))
"""


def fake_side(name: str, step_s: float, log: Path) -> e2e.Side:
    return e2e.Side(name, lambda precision: [sys.executable, "-c", FAKE, name, precision, str(step_s), str(log)],
                    keep=("loss_last",))


@pytest.mark.slow
def test_rounds_interleave_fresh_processes(tmp_path):
    log = tmp_path / "order.log"
    sides = [fake_side("A", 0.1, log), fake_side("B", 0.2, log)]
    out = e2e.run_rounds(sides, ["fp32", "bf16"], rounds=3, timeout_s=60)
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [(n, p) for n, p, _ in lines] == [("A", "fp32"), ("B", "fp32"), ("A", "bf16"), ("B", "bf16")] * 3
    assert len({pid for _, _, pid in lines}) == len(lines)  # a fresh process every time
    assert [len(out[p]) for p in ("fp32", "bf16")] == [3, 3]
    row = out["fp32"][0]["A"]
    assert row["tokens_per_step"] == 100 and row["loss_last"] == 1.0
    assert row["tokens_per_s"] == pytest.approx(100 / 0.101)
    ratio = rate_ratio(e2e.side_step_runs(out["fp32"], "A"), e2e.side_step_runs(out["fp32"], "B"), 100, 100)
    assert ratio.runs == (3, 3) and ratio.value == pytest.approx(2.0)
    assert ratio.low <= 2.0 <= ratio.high


@pytest.mark.slow
def test_a_failed_process_costs_only_its_row(tmp_path):
    log = tmp_path / "order.log"
    out = e2e.run_rounds([fake_side("A", 0.1, log), fake_side("B", -1, log)], ["fp32"], rounds=2, timeout_s=60)
    assert all("boom" in row["B"]["error"] for row in out["fp32"])
    assert e2e.side_step_runs(out["fp32"], "B") == [] and len(e2e.side_step_runs(out["fp32"], "A")) == 2
    table = e2e.format_rounds({"sides": ["A", "B"], "rounds": out}, "fp32")
    assert "failed" in table[1] and any("boom" in line for line in table)


@pytest.mark.slow
def test_cli_without_transformers_times_moebench_alone(tmp_path, monkeypatch):
    log = tmp_path / "order.log"
    monkeypatch.setattr(e2e, "transformers_version", lambda: None)
    monkeypatch.setattr(e2e, "moebench_command", lambda shape, precision, timing: fake_side("moebench", 0.1, log)
                        .command(precision))
    result = CliRunner().invoke(cli, ["bench", "e2e", "--rounds", "2", "--precision", "fp32"])
    assert result.exit_code == 0, result.output
    assert result.output.count("transformers is not installed") == 1
    assert "moebench tok/s" in result.output and "moebench / transformers" not in result.output
    assert len(log.read_text().splitlines()) == 2

    result = CliRunner().invoke(cli, ["bench", "e2e", "--rounds", "2", "--precision", "fp32", "--json"])
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["transformers"] is None and data["sides"] == ["moebench"] and data["comparisons"] == []


@pytest.mark.slow
def test_compiled_side_and_every_comparison(tmp_path, monkeypatch):
    """--compiled adds a moebench process with train.compile=true in every round; the result compares
    moebench with transformers and compiled with eager at each precision, and bf16 with fp32."""
    log = tmp_path / "order.log"
    steps = {("moebench", "fp32"): 0.4, ("moebench", "bf16"): 0.2, ("moebench compiled", "fp32"): 0.5,
             ("moebench compiled", "bf16"): 0.1, ("transformers", "fp32"): 0.8, ("transformers", "bf16"): 0.8}
    monkeypatch.setattr(e2e, "transformers_version", lambda: "0.0")
    monkeypatch.setattr(e2e, "olmoe_config_kwargs", lambda cfg: {})

    def moebench(shape, precision, timing, compiled=False):
        name = "moebench compiled" if compiled else "moebench"
        assert f"train.compile={str(compiled).lower()}" in e2e.moebench_overrides(shape, precision, timing, compiled)
        return fake_side(name, steps[name, precision], log).command(precision)

    monkeypatch.setattr(e2e, "moebench_command", moebench)
    monkeypatch.setattr(e2e, "transformers_command",
                        lambda shape, precision, timing: fake_side("transformers", 0.8, log).command(precision))
    result = CliRunner().invoke(cli, ["bench", "e2e", "--rounds", "2", "--compiled", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["sides"] == ["moebench", "moebench compiled", "transformers"]
    assert [line.split()[0] for line in log.read_text().splitlines()] == \
        ["moebench", "moebench", "transformers"] * 4  # "moebench compiled" logs its first word
    got = {(c["label"], c["precision"]): round(c["value"], 2) for c in data["comparisons"]}
    assert got == {("moebench / transformers", "fp32"): 2.0, ("moebench / transformers", "bf16"): 4.0,
                   ("compiled / eager", "fp32"): 0.8, ("compiled / eager", "bf16"): 2.0,
                   ("moebench bf16 / fp32", "bf16 vs fp32"): 2.0}
    assert all(c["runs"] == [2, 2] for c in data["comparisons"])
    text = CliRunner().invoke(cli, ["bench", "e2e", "--rounds", "2", "--compiled", "--precision", "bf16"]).output
    assert "compiled / eager tokens/s, bf16: 2.00x" in text and "bf16 / fp32" not in text
    head = next(line for line in text.splitlines() if line.split()[:3] == ["round", "moebench", "tok/s"])
    assert head.split("tok/s")[-1].split() == ["moebench", "/", "transformers", "compiled", "/", "eager"]


def test_shape_maps_to_olmoe_config():
    shape = e2e.E2EShape()
    cfg = e2e.moebench_config(shape, "bf16")
    kw = e2e.olmoe_config_kwargs(cfg)
    assert (kw["hidden_size"], kw["num_hidden_layers"], kw["num_attention_heads"], kw["num_key_value_heads"]) == \
        (512, 4, 8, 8)
    assert (kw["num_experts"], kw["num_experts_per_tok"], kw["intermediate_size"], kw["vocab_size"]) == \
        (32, 4, 256, 4096)
    assert kw["output_router_logits"] and kw["router_aux_loss_coef"] == cfg.moe.lb_loss_weight
    assert cfg.tokens_per_step == shape.tokens_per_step == 1024 and cfg.precision.mode == "bf16"
    assert cfg.train.timed_steps == e2e.Timing().steps


def test_a_config_olmoe_cannot_express_is_one_clear_error():
    cfg = e2e.moebench_config(e2e.E2EShape())
    cfg.moe.shared_expert_hidden = 64
    cfg.model.n_dense_layers = 1
    with pytest.raises(ConfigError, match=r"model\.n_dense_layers, moe\.shared_expert_hidden: not expressible"):
        e2e.olmoe_config_kwargs(cfg)


def test_olmoe_has_moebench_parameter_count():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (moebench[e2e])")
    import torch

    from moebench.model.transformer import Transformer

    cfg = e2e.moebench_config(e2e.E2EShape(vocab=256, d_model=64, layers=2, heads=4, experts=8, top_k=2, hidden=32))
    with torch.device("meta"):  # shapes only: no memory, no init
        ours = Transformer(cfg)
        theirs = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**e2e.olmoe_config_kwargs(cfg)))
    count = sum(p.numel() for p in theirs.parameters())
    assert count == sum(p.numel() for p in ours.parameters()) == cfg.total_params()


def test_cli_offers_the_expert_paths_e2e_knows():
    from moebench.cli import bench_e2e

    option = next(p for p in bench_e2e.params if p.name == "hf_experts")
    assert tuple(option.type.choices) == e2e.HF_EXPERTS


@pytest.mark.slow
def test_breakdown_profiles_moebench_and_prints_phase_medians(tmp_path, monkeypatch):
    log, seen = tmp_path / "order.log", []
    monkeypatch.setattr(e2e, "transformers_version", lambda: None)

    def moebench(shape, precision, timing, compiled=False):
        seen.append(e2e.moebench_overrides(shape, precision, timing, compiled))
        return fake_side("moebench", 0.1, log).command(precision)

    monkeypatch.setattr(e2e, "moebench_command", moebench)
    assert CliRunner().invoke(cli, ["bench", "e2e", "--rounds", "1", "--breakdown"]).exit_code == 0
    assert all("train.phase_clock=true" in sets for sets in seen) and len(seen) == 2

    run = {"time_breakdown_s": {"experts": 0.25, "attention": 0.18, "optimizer": 0.08, "other": 0.0001},
           "breakdown_step_s": 0.6}
    later = {**run, "time_breakdown_s": {**run["time_breakdown_s"], "experts": 0.27}, "breakdown_step_s": 0.62}
    result = {"sides": ["moebench", "transformers"],
              "rounds": {"fp32": [{"moebench": run, "transformers": {}}, {"moebench": later},
                                  {"moebench": {"error": "boom"}}]}}
    assert e2e.breakdown_lines(result) == [
        "fp32 moebench: experts 260, attention 180, optimizer 80 ms (timed step 610 ms, median of 2 runs)"]


def _olmoe_like():
    """Parameters shaped like OLMoE's: matrices, stacked experts, and norm gains (1-D)."""
    import torch

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(16, 8)
    model.norm = torch.nn.RMSNorm(8)
    model.experts = torch.nn.Parameter(torch.zeros(4, 8, 16))
    model.head = torch.nn.Linear(8, 16, bias=True)
    return model


def test_transformers_side_runs_moebench_optimizer():
    """The transformers side's AdamW is torch's fused kernel and decays exactly the tensors moebench's
    trainer decays (matrices; not norm gains nor biases), at the settings the command passes it."""
    import torch

    from moebench.bench import e2e_hf
    from moebench.parallel.strategy import LocalGrads

    shape = e2e.E2EShape()
    cfg = e2e.moebench_config(shape)
    argv = e2e.transformers_command(shape, "fp32", e2e.Timing())[3:]  # after python -m moebench.bench.e2e_hf
    model = _olmoe_like()
    theirs = e2e_hf.build_optimizer(model, e2e_hf.parse_args(argv))
    ours = LocalGrads(model).build_optimizer(cfg)  # what moebench's one-process trainer builds
    assert theirs.defaults["fused"] is True and ours.defaults["fused"] is True

    def decays(opt: torch.optim.Optimizer) -> dict[int, float]:
        return {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}

    assert decays(theirs) == decays(ours)
    assert decays(theirs)[id(model.norm.weight)] == 0.0 and decays(theirs)[id(model.head.bias)] == 0.0
    assert decays(theirs)[id(model.experts)] == cfg.train.weight_decay > 0
    for got, want in zip(theirs.param_groups, ours.param_groups, strict=True):
        assert (got["lr"], got["betas"]) == (want["lr"], want["betas"])
    assert e2e.moebench_kernels(cfg)["optimizer"].startswith("AdamW fused, decay 0.1 on ")
    assert e2e.moebench_kernels(cfg)["loss"] == "cross-entropy + 0.01 x load-balancing"


def test_transformers_side_falls_back_to_foreach_without_a_fused_kernel(monkeypatch):
    """On a torch without a fused CPU AdamW the transformers side runs the next fastest, foreach
    (not torch's default for-loop), with the same decay rule, and says so."""
    from moebench.bench import e2e_hf
    from moebench.parallel.optimizer import adamw_kernel

    assert e2e_hf.fused_adamw_supported(e2e_hf.CPU)  # torch 2.4+ has one: the fused kernel runs here
    monkeypatch.setattr(e2e_hf, "fused_adamw_supported", lambda device: False)
    argv = e2e.transformers_command(e2e.E2EShape(), "fp32", e2e.Timing())[3:]
    opt = e2e_hf.build_optimizer(_olmoe_like(), e2e_hf.parse_args(argv))
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    assert adamw_kernel(opt) == "AdamW foreach, decay 0.1 on 3 of 5 tensors"


@pytest.mark.slow
def test_output_names_each_side_kernels(tmp_path, monkeypatch):
    """Every row says what its side ran, and the text output prints it per side and precision."""
    log = tmp_path / "order.log"
    monkeypatch.setattr(e2e, "transformers_version", lambda: "0.0")
    monkeypatch.setattr(e2e, "olmoe_config_kwargs", lambda cfg: {})
    monkeypatch.setattr(e2e, "moebench_command", lambda shape, precision, timing, compiled=False:
                        fake_side("moebench", 0.1, log).command(precision))
    monkeypatch.setattr(e2e, "transformers_command",
                        lambda shape, precision, timing: fake_side("transformers", 0.2, log).command(precision))
    text = CliRunner().invoke(cli, ["bench", "e2e", "--rounds", "1", "--precision", "fp32"]).output
    ours = next(line for line in text.splitlines() if line.startswith("fp32 moebench: "))
    assert "optimizer AdamW fused, decay 0.1 on " in ours and "attention sdpa" in ours
    assert "norm RMSNorm torch _fused_rms_norm forward, hand-written backward (model.norm_impl=recompute)" in ours
    assert "loss cross-entropy + 0.01 x load-balancing" in ours
    theirs = next(line for line in text.splitlines() if line.startswith("fp32 transformers: "))
    assert theirs == "fp32 transformers: optimizer ?; attention ?; norm ?; experts ?; loss ?"  # the fake prints none


def test_transformers_side_reports_its_kernels():
    pytest.importorskip("transformers", reason="transformers is not installed (moebench[e2e])")
    from moebench.bench import e2e_hf

    shape = e2e.E2EShape(vocab=64, d_model=32, layers=1, heads=2, experts=4, top_k=2, hidden=16, seq_len=8,
                         micro_batch=1)
    argv = e2e.transformers_command(shape, "fp32", e2e.Timing(warmup=0, steps=1))[3:]
    line = e2e_hf.train(e2e_hf.parse_args(argv))
    assert line["optimizer"].startswith("AdamW fused, decay 0.1 on ")
    assert (line["attention"], line["experts"], line["norm"]) == ("sdpa", "grouped_mm", "OlmoeRMSNorm (torch ops)")
    assert line["loss"] == e2e.moebench_kernels(e2e.moebench_config(shape))["loss"]
