"""The shipped published operating points (moebench/published/*.yaml) and their loader."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from moebench.errors import ConfigError
from moebench.plan.published import NOT_STATED, PUBLISHED_DIR, load_published, read_published_file

ROWS = {r.id: r for r in load_published()}


def _value(row_id: str, metric: str) -> float:
    return next(m.value for m in ROWS[row_id].measured if m.metric == metric)


def test_one_calibration_row_the_four_b300_bf16_point():
    assert [r.id for r in ROWS.values() if r.calibration] == ["olmo3-4xb300-e32-bf16"]


def test_four_b300_rows_say_what_the_report_says():
    bf16 = ROWS["olmo3-4xb300-e32-bf16"]
    assert (bf16.gpu, bf16.gpus, bf16.preset, bf16.routing, bf16.precision) == ("b300", 4, "moe-8l-e32", "uniform",
                                                                               "bf16")
    assert (bf16.layout.ep, bf16.layout.dist_opt, bf16.layout.ep_transport) == (4, True, "row-wise")
    assert bf16.batch.micro_batch_sequences == 2 and bf16.batch.tokens_per_step == 524_288
    assert _value(bf16.id, "tokens_per_s_per_device") == 54_680
    # the peak is the persistent plus the transient part, as published
    assert _value(bf16.id, "persistent_mem_gib") + _value(bf16.id, "transient_mem_gib") == pytest.approx(
        _value(bf16.id, "peak_mem_gib"), abs=0.005)
    assert _value(bf16.id, "ep_buffer_gib") == 5.00 and _value("olmo3-4xb300-e32-mxfp8", "ep_buffer_gib") == 2.836
    # recompute: -20.95% and -26.13 GiB against BF16 (the K-rounded rates give -20.96%)
    rec = "olmo3-4xb300-e32-recompute"
    assert ROWS[rec].recompute == "per-layer"
    assert 1 - _value(rec, "tokens_per_s_per_device") / _value(bf16.id, "tokens_per_s_per_device") == pytest.approx(
        0.2095, abs=2e-4)
    assert _value(bf16.id, "peak_mem_gib") - _value(rec, "peak_mem_gib") == pytest.approx(26.13, abs=0.005)
    mx = next(m for m in ROWS["olmo3-4xb300-e32-mxfp8"].measured if m.metric == "tokens_per_s_ratio")
    assert (mx.value, mx.relative_to, mx.approximate) == (1.21, bf16.id, True)
    tbo = ROWS["olmo3-4xb300-e32-tbo"]
    assert tbo.layout.two_batch_overlap and _value(tbo.id, "tokens_per_s_ratio") == 1.01


def test_scale_table_rows():
    tflops = {r.model_name: _value(r.id, "tflops_per_device") for r in ROWS.values() if r.id.startswith("olmo3-")
              and any(m.metric == "tflops_per_device" for m in r.measured)}
    assert tflops == {"Tiny-64E": 903, "Small-64E": 841, "Medium-64E": 853, "Medium-96E": 855, "Medium-128E": 843,
                      "Large-128E": 768, "Ultra-128E": 858, "Ultra-256E": 689}
    ultra = (("olmo3-ultra-128e", "ultra-1.2t", 8, 1), ("olmo3-ultra-256e", "ultra-2.38t", 32, 2))
    for row_id, preset, ep, seqs in ultra:
        row = ROWS[row_id]
        assert (row.preset, row.layout.ep, row.layout.pp, row.layout.virtual_stages) == (preset, ep, 8, 2)
        assert (row.routing, row.precision, row.precision_scope, row.recompute) == ("random", "mxfp8", "linear",
                                                                                    "per-layer")
        assert row.capacity_factor == 1.1875 and row.batch.micro_batch_sequences == seqs
        assert row.batch.tokens_per_step == 64 * 2**20  # 64 Mi tokens a step
    # Tiny..Large as their scripts lay them out: (preset, GPUs, EP, PP, virtual stages, rank micro-batch,
    # Mi tokens a step); BF16, no recompute, random routing, the distributed optimizer
    scale = {
        "olmo3-tiny-64e": ("olmoe3-tiny-64e", 16, 1, 1, 1, 8, 8),
        "olmo3-small-64e": ("olmoe3-small-64e", 128, 8, 1, 1, 3, 24),
        "olmo3-medium-64e": ("olmoe3-medium-64e", 128, 8, 2, 2, 2, 16),
        "olmo3-medium-96e": ("olmoe3-medium-96e", 128, 8, 2, 2, 2, 24),
        "olmo3-medium-128e": ("olmoe3-medium-128e", 128, 8, 4, 2, 2, 24),
        "olmo3-large-128e": ("olmoe3-large-128e", 512, 8, 4, 2, 1, 32),
    }
    for row_id, (preset, gpus, ep, pp, vs, seqs, mi) in scale.items():
        row = ROWS[row_id]
        assert (row.preset, row.gpus, row.layout.ep, row.layout.pp, row.layout.virtual_stages) == (
            preset, gpus, ep, pp, vs), row_id
        assert (row.batch.micro_batch_sequences, row.batch.tokens_per_step) == (seqs, mi * 2**20), row_id
        assert (row.routing, row.precision, row.recompute, row.layout.dist_opt) == ("random", "bf16", "none", True)
        assert row.layout.ep_transport == ("row-wise" if ep > 1 else NOT_STATED), row_id
        assert "highest observed" in row.statistic
    # OLMo-core's pipelined runs: 2 x PP stages of ORIGINAL_NUM_LAYERS / (2 x PP) layers, the last one short
    for row_id, per_stage, stages in (("olmo3-medium-96e", 10, 4), ("olmo3-medium-128e", 5, 8),
                                      ("olmo3-large-128e", 6, 8), ("olmo3-ultra-128e", 4, 16)):
        assert ROWS[row_id].layout.stage_layers == (per_stage,) * (stages - 1) + (per_stage - 1,), row_id


def test_megatron_and_torchtitan_rows():
    expect = {  # id: (gpu, gpus, tokens/s, TFLOP/s)
        "megatron-deepseek-v3-256xgb300-mxfp8": ("gb300", 256, 6422, 1670),
        "megatron-deepseek-v3-256xb300-mxfp8": ("b300", 256, 3131, 814),
        "megatron-deepseek-v3-256xb200-mxfp8": ("b200", 256, 2815, 732),
        "megatron-qwen3-235b-256xgb300-mxfp8": ("gb300", 256, 9033, 1337),
        "megatron-gpt-oss-120b-64xgb300-mxfp8": ("gb300", 64, 33166, 1081),
        "megatron-qwen3-30b-8xb300-mxfp8": ("b300", 8, 30553, 703),
        "torchtitan-qwen3-30b-8xb200-deepep": ("b200", 8, 14796, 341),
    }
    got = {i: (ROWS[i].gpu, ROWS[i].gpus, _value(i, "tokens_per_s_per_device"), _value(i, "tflops_per_device"))
           for i in expect}
    assert got == expect
    assert all(ROWS[i].routing == "force-balanced" for i in expect if i.startswith("megatron-"))
    titan = ROWS["torchtitan-qwen3-30b-8xb200-deepep"]
    assert _value(titan.id, "peak_mem_gib") == 167.93 and titan.batch.seq_len == NOT_STATED


def test_package_ships_the_published_files():
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"published/*.yaml"' in pyproject
    assert PUBLISHED_DIR.is_dir() and sorted(p.name for p in PUBLISHED_DIR.glob("*.yaml"))


GOOD_ROW = """
    id: r1
    description: a row
    hardware: {gpu: b300, gpus: 8}
    model: {name: m, preset: moe-8l-e32, total_params: not stated, active_params: 3.0e+9}
    layout: {data_parallel: ddp, dist_opt: true, ep: 8, pp: 1, ep_transport: row-wise}
    batch: {seq_len: 8192, micro_batch_sequences: 2, global_batch_sequences: 64}
    routing: random
    capacity_factor: 1.25
    precision: bf16
    precision_scope: not stated
    recompute: none
    measured:
      - {metric: tokens_per_s_per_device, value: 1000}
    statistic: mean
    protocol: not stated
"""


def _write(tmp_path: Path, rows: list[dict], name: str = "src.yaml", implementation: object = None) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"source": {"title": "t", "where": "w"},
                                    "implementation": {} if implementation is None else implementation,
                                    "rows": rows}))
    return path


def _row(**changes) -> dict:
    row = yaml.safe_load(textwrap.dedent(GOOD_ROW))
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if field:
            row[section][field] = value
        elif value is None:
            del row[section]
        else:
            row[section] = value
    return row


def test_a_good_row_loads(tmp_path):
    (row,) = load_published([_write(tmp_path, [_row()])])
    assert (row.id, row.role, row.total_params, row.active_params) == ("r1", "held-out", NOT_STATED, 3e9)


@pytest.mark.parametrize("changes,field,says", [
    ({"hardware.gpu": "b900"}, "rows[0] (r1).hardware.gpu", "'b900' is not one of"),
    ({"model.preset": "nope"}, "rows[0] (r1).model.preset", "unknown preset 'nope'"),
    ({"layout.ep": 0}, "rows[0] (r1).layout.ep", "integer >= 1"),
    ({"layout.ep": 3}, "rows[0] (r1).layout", "not pp x tp x cp x a multiple of ep"),
    ({"layout.colour": 1}, "rows[0] (r1).layout.colour", "unknown key"),
    ({"layout.stage_layers": [4, 4]}, "rows[0] (r1).layout.stage_layers", "2 stages, but pp=1 x virtual_stages=1"),
    ({"layout.stage_layers": [4, 0]}, "rows[0] (r1).layout.stage_layers[1]", "integer >= 1"),
    ({"layout.stage_layers": 4}, "rows[0] (r1).layout.stage_layers", "non-empty list of integers"),
    ({"routing": None}, "rows[0] (r1).routing", "missing (write 'not stated'"),
    ({"routing": "sticky"}, "rows[0] (r1).routing", "'sticky' is not one of"),
    ({"capacity_factor": "lots"}, "rows[0] (r1).capacity_factor", "finite number"),
    ({"measured": []}, "rows[0] (r1).measured", "non-empty list"),
    ({"measured": [{"metric": "speed", "value": 1}]}, "rows[0] (r1).measured[0].metric", "'speed' is not one of"),
    ({"measured": [{"metric": "tokens_per_s_ratio", "value": 1.2}]}, "rows[0] (r1).measured[0].relative_to",
     "required for tokens_per_s_ratio"),
    ({"measured": [{"metric": "peak_mem_gib", "value": -3}]}, "rows[0] (r1).measured[0].value", "must be > 0"),
    ({"implementation": {"parallel.ep": 8}}, "rows[0] (r1).implementation.parallel.ep",
     "not an implementation setting (allowed: precision.param_dtype, model.norm_impl, model.loss_chunk_tokens)"),
    ({"implementation": {"model.norm_impl": "fused"}}, "rows[0] (r1).implementation.model.norm_impl",
     "bad value 'fused' for model.norm_impl; allowed: torch, recompute"),
    ({"implementation": {"model.loss_chunk_tokens": "many"}}, "rows[0] (r1).implementation.model.loss_chunk_tokens",
     "bad value 'many'"),
    ({"implementation": ["model.norm_impl=recompute"]}, "rows[0] (r1).implementation", "must be a mapping"),
])
def test_bad_rows_fail_in_one_line_naming_file_and_field(tmp_path, changes, field, says):
    path = _write(tmp_path, [_row(**changes)])
    with pytest.raises(ConfigError) as info:
        read_published_file(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: {field}: ") and says in message, message


def test_implementation_settings_of_the_file_and_of_a_row(tmp_path):
    """The file's settings apply to each row that states none; a row's own replace them."""
    fused = {"precision.param_dtype": "bf16", "model.norm_impl": "recompute", "model.loss_chunk_tokens": 1024}
    own = _row(id="r2", implementation={"model.norm_impl": "recompute", "model.loss_chunk_tokens": "none"})
    first, second = load_published([_write(tmp_path, [_row(), own], implementation=fused)])
    assert first.implementation == fused
    assert second.implementation == {"model.norm_impl": "recompute", "model.loss_chunk_tokens": None}


@pytest.mark.parametrize("top,says", [
    ({"source": {"title": "t", "where": "w"}, "rows": []}, "implementation: missing (write {} if the source"),
    ({"source": {"title": "t", "where": "w"}, "implementation": {"model.colour": 1}, "rows": []},
     "implementation.model.colour: not an implementation setting"),
])
def test_a_file_states_its_implementation_settings(tmp_path, top, says):
    path = tmp_path / "src.yaml"
    path.write_text(yaml.safe_dump({**top, "rows": [_row()]}))
    with pytest.raises(ConfigError) as info:
        read_published_file(path)
    assert str(info.value).startswith(f"{path}: {says}") and "\n" not in str(info.value), info.value


def test_shipped_implementation_settings():
    """OLMo-core's rows mirror its implementation (the fused loss on the 4-B300 benchmark only: the
    scale-table scripts set the unfused one, and moebench's needs pp=1); Megatron-Bridge and torchtitan
    state none."""
    olmo = {"precision.param_dtype": "bf16", "model.norm_impl": "recompute"}
    for row in ROWS.values():
        if row.id.startswith("olmo3-"):
            fused_loss = {"model.loss_chunk_tokens": 1024} if row.id.startswith("olmo3-4xb300-") else {}
            assert row.implementation == olmo | fused_loss, row.id
        else:
            assert row.implementation == {}, row.id


def test_ids_are_unique_and_relative_rows_exist(tmp_path):
    a = _write(tmp_path, [_row()], "a.yaml")
    b = _write(tmp_path, [_row()], "b.yaml")
    with pytest.raises(ConfigError, match=r"b\.yaml: rows \(r1\)\.id: also in .*a\.yaml"):
        load_published([a, b])
    ratio = _row(id="r2", measured=[{"metric": "tokens_per_s_ratio", "value": 1.2, "relative_to": "r9"}])
    with pytest.raises(ConfigError, match=r"rows \(r2\)\.measured \(tokens_per_s_ratio\)\.relative_to: no row 'r9'"):
        load_published([_write(tmp_path, [_row(), ratio], "c.yaml")])


def test_unreadable_file_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("source: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        read_published_file(path)
    assert str(info.value).startswith(f"{path}: cannot read:") and "\n" not in str(info.value)
