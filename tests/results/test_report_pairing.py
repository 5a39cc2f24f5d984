"""The tidy table and baseline pairing."""

from __future__ import annotations

import pandas as pd
import pytest
from report_helpers import edited_store, fixture_store

from moebench.errors import StoreError
from moebench.results.pairing import pair_with_baseline
from moebench.results.table import load_tables, norm_value, variant_label

SMOKE = fixture_store("smoke")


def test_tidy_columns_from_the_store(tmp_path):
    t, metas, warnings = load_tables([SMOKE])
    assert warnings == [] and metas[0]["suite"] == "smoke"
    row = t.set_index("point_id").loc["ddp-rowwise"]
    assert (row["variant"], row["world_size"], row["num_experts"]) == ("ddp ep2 rowwise", 2, 8)
    assert row["comm_bytes_total"] == row["comm_dp_bytes"] + row["comm_ep_bytes"] + row["comm_edp_bytes"]
    assert row["load_imbalance"] == pytest.approx(sum(row["expert_load_max_over_mean"]) / 20)
    assert len(row["step_times_s"]) == 20


def test_baseline_selector_comes_from_meta(tmp_path):
    selector = {"parallel.strategy": "ddp", "parallel.dispatcher": "sync"}
    store = edited_store(SMOKE, tmp_path / "s", meta_edit=lambda m: m.update(baseline=selector))
    t, metas, _ = load_tables([store])
    t = pair_with_baseline(t, metas).set_index("point_id")
    assert set(t["baseline_point_id"]) == {"ddp"}
    assert t.at["fsdp", "speedup"] == pytest.approx(t.at["fsdp", "tokens_per_s"] / t.at["ddp", "tokens_per_s"])
    assert t.at["ddp", "speedup"] == 1.0


def test_failed_baseline_leaves_points_unpaired(tmp_path):
    store = edited_store(SMOKE, tmp_path / "s", lambda r: {**r, "status": "oom"} if r["point_id"] == "fsdp" else r)
    t, metas, _ = load_tables([store])
    t = pair_with_baseline(t, metas)
    assert t["baseline_point_id"].isna().all() and t["speedup"].isna().all()


def test_different_model_is_not_paired(tmp_path):
    def bigger(r):
        if r["point_id"] == "ddp":
            r["config"]["moe"]["num_experts"] = 16
        return r

    t, metas, _ = load_tables([edited_store(SMOKE, tmp_path / "s", bigger)])
    t = pair_with_baseline(t, metas).set_index("point_id")
    assert pd.isna(t.at["ddp", "baseline_point_id"]) and t.at["ddp-rowwise", "baseline_point_id"] == "fsdp"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("tokens_per_s", "fast", "'tokens_per_s' is 'fast', not a number"),
    ("step_times_s", "0.1,0.2", "'step_times_s' must be a list of numbers"),
    ("step_times_s", [0.1, "x"], "'step_times_s' must be a list of numbers"),
])
def test_bad_field_types_raise_store_error(tmp_path, field, value, message):
    store = edited_store(SMOKE, tmp_path / "s", lambda r: {**r, field: value})
    with pytest.raises(StoreError, match=message):
        load_tables([store])


def test_labels_and_values():
    assert variant_label("ddp", 8, 1, "rowwise", True) == "ddp ep8 rowwise dist-opt"
    assert variant_label("fsdp", 1, 2, "rowwise", False) == "fsdp pp2"
    assert variant_label("ddp", 1, 1, "sync", False, True) == "ddp compiled"
    assert variant_label("ddp", 1, 1, "sync", False, None) == "ddp"  # a record from before train.compile
    assert [norm_value(v) for v in (2.0, True, None, float("nan"), "x")] == ["2", "true", "none", "none", "x"]


def test_baseline_may_come_from_another_run_on_the_same_machine(tmp_path):
    def only(strategy, run_id):
        return edited_store(SMOKE, tmp_path / run_id,
                            lambda r: r if r["layout"]["strategy"] == strategy else None,
                            meta_edit=lambda m: m.update(run_id=run_id))

    t, metas, _ = load_tables([only("fsdp", "run-a"), only("ddp", "run-b")])
    t = pair_with_baseline(t, metas).set_index("point_id")
    assert t.at["ddp", "baseline_point_id"] == "fsdp" and t.at["ddp", "speedup"] > 1.0
    # Two runs of one suite: every row names its run (run id tail and commit), not only the suite.
    assert t.at["ddp", "label"].startswith("run-b@0d579b9: ") and t.at["fsdp", "run"] == "run-a@0d579b9"


def test_baseline_selector_on_precision_pairs_across_precisions(tmp_path):
    store = edited_store(fixture_store("expert-scaling"), tmp_path / "s",
                         meta_edit=lambda m: m.update(baseline={"precision": "bf16"}))
    t, metas, _ = load_tables([store])
    t = pair_with_baseline(t, metas).set_index("point_id")
    assert t.at["e8-ddp-fp32", "baseline_point_id"] == "e8-ddp"  # same layout preferred
    assert t.at["e8-fsdp-fp32", "baseline_point_id"] == "e8-fsdp"
    assert t.at["e8-fsdp-fp32", "speedup"] < 0.5


def test_points_sort_by_axis_numbers_when_every_point_has_the_axis(tmp_path):
    """A column every point fills is read back as numpy integers, which are not Python ints: they
    sorted as text (num_experts 16, 32, 64 before 8) in the points table and every figure."""
    def at_three_sizes(r):
        out = []
        for n in (16, 8, 64):
            copy = {**r, "point_id": f"{r['point_id']}-e{n}", "key": f"{r.get('key')}-e{n}",
                    "point": {**r["point"], "moe.num_experts": n}}
            out.append(copy)
        return out

    store = edited_store(fixture_store("smoke"), tmp_path / "s", at_three_sizes)
    t, _, _ = load_tables([store])
    fsdp = t[t["point_id"].str.startswith("fsdp")]
    assert [int(n) for n in fsdp["point.moe.num_experts"]] == [8, 16, 64]
