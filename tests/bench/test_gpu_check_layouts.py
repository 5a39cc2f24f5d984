"""The multi-GPU check's layout section (``scripts/gpu_check.sh OUT --ranks N``), on 2 gloo ranks:
a layout that computes the reference's math passes, one that does not (another lr) fails the
section and the check, and bad ``--ranks`` values are refused before anything runs."""

from __future__ import annotations

import time

import pytest
import torch

from moebench.bench import gpu_check
from moebench.bench.layout_parity import LOSS_RTOL, check_ranks, layout_rows, layouts, loss_mismatch, section_layouts


def test_loss_mismatch_names_the_worst_step_and_the_tolerance():
    assert loss_mismatch([5.0, 4.9], [5.0, 4.9 * (1 + LOSS_RTOL / 2)]) is None
    assert loss_mismatch([5.0, 4.9], [5.0, 4.8]) == f"step 1: loss off by 2.1e-02 (tolerance {LOSS_RTOL:g})"
    assert loss_mismatch([5.0], [5.0, 4.9]) == "1 losses vs the reference's 2"


@pytest.mark.parametrize("ranks", [1, 3, 10])
def test_ranks_that_cannot_share_the_global_batch_are_refused(ranks, tmp_path, capsys):
    with pytest.raises(ValueError, match=f"--ranks {ranks}: the multi-GPU check needs an even number"):
        check_ranks(ranks)
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([str(tmp_path / "out"), "--device", "cpu", "--ranks", str(ranks)])
    assert exc.value.code == 2 and "an even number of ranks from 2 to 8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_every_layout_splits_the_batch_over_the_ranks():
    for ranks in (2, 4, 8):
        chosen = layouts(ranks)
        assert set(chosen) == {"fsdp", "ddp_ep_sync", "ddp_ep_rowwise", "ddp_dist_opt", "pp2"}
        assert f"parallel.dp={ranks // 2}" in chosen["pp2"] and f"parallel.dp={ranks}" in chosen["fsdp"]
    assert gpu_check.all_sections(None, 2)[-1][0] == "layouts" and "layouts" not in dict(
        (n, f) for n, f, _ in gpu_check.all_sections(None))


@pytest.mark.slow
def test_a_layout_with_other_math_fails_the_section():
    ctx = {"ranks": 2, "device": torch.device("cpu"), "deadline": time.monotonic() + 300,
           "layouts": {"fsdp": layouts(2)["fsdp"], "other_lr": ("parallel.dp=2", "train.lr=2e-3")}}
    result = section_layouts(ctx)
    assert result["fsdp"].get("mismatch", "no run") is None and result["fsdp"]["tokens_per_s"] > 0, result["fsdp"]
    assert "loss off by" in result["other_lr"]["mismatch"]
    assert result["failed"] == ["other_lr"] and result["ok"] is False
    verdict, why = gpu_check.section_verdict("layouts", result)
    assert verdict == "FAIL" and "other_lr" in why
    rows = {name: value for name, _, value in layout_rows(result)}
    assert rows["layout fsdp (2 ranks)"].endswith(f"losses match (rtol {LOSS_RTOL:g})")
    assert "loss off by" in rows["layout other_lr (2 ranks)"]
