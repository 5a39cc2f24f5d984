"""The peak MFU divides by: a CPU's calibration matmul in the dtype the convention names (bf16 where the
CPU has it, as a GPU's bf16 datasheet peak serves every precision), named in the record; an MFU above
it is flagged, not clipped."""

import json

import pytest
import torch

from moebench.metrics import CPU_PEAK_FILE_ENV, flops
from moebench.presets import load_config
from moebench.record import derived_metrics
from moebench.train.run import run_training, summary_lines

TINY = ["train.steps=3", "train.warmup_steps=1", "train.profile_steps=0"]


@pytest.fixture(scope="module")
def calibration() -> tuple[float, str]:
    return flops.calibrate_cpu_peak()


def test_the_cpu_peak_is_its_faster_matmul_dtype(monkeypatch):
    """bf16 where its matmul outruns fp32 (the CPU has bf16), else fp32: the peak beats both rates."""
    rates = {torch.bfloat16: 3.0e11, torch.float32: 1.0e11}
    monkeypatch.setattr(flops, "matmul_flops", lambda dtype: rates[dtype])
    assert flops.calibrate_cpu_peak() == (3.0e11, "bf16")
    rates[torch.bfloat16] = 0.2e11  # bf16 emulated in software: slower than fp32
    assert flops.calibrate_cpu_peak() == (1.0e11, "fp32")


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_a_cpu_run_names_its_peak_dtype_and_stays_below_it(mode, calibration, monkeypatch):
    """A bf16 run on a CPU with bf16, measured against an fp32 calibration, read above 100% MFU; against
    the faster dtype's it stays below 1, and an fp32 run names its calibration dtype too."""
    monkeypatch.setattr(flops, "calibrate_cpu_peak", lambda: calibration)
    record = run_training(load_config("tiny", [*TINY, f"precision.mode={mode}", "train.device=cpu"]))
    assert record["status"] == "ok" and record["precision"] == mode
    assert record["peak_flops_dtype"] == calibration[1] in ("bf16", "fp32")
    assert record["cpu_threads"] == torch.get_num_threads()  # what the report's device phrase says per rank
    assert f"calibration {calibration[1]} matmul" in record["peak_flops_source"]
    assert 0 < record["mfu"] <= 1 and record["mfu_above_peak"] is False


def test_an_mfu_above_the_peak_is_flagged_not_clipped(monkeypatch):
    """A calibration that read slow (noise, a busy machine) leaves an MFU above 1: kept as measured,
    flagged in the record and in the summary."""
    monkeypatch.setattr(flops, "calibrate_cpu_peak", lambda: (1.0e6, "bf16"))
    record = run_training(load_config("tiny", TINY))
    assert record["mfu"] > 1 and record["mfu_above_peak"] is True
    assert any("above the peak" in line for line in summary_lines(record))
    assert derived_metrics(1000, 1.0, 1, 100, 2.0e5) == {
        "tokens_per_s": 1000.0, "tokens_per_s_per_device": 1000.0, "tflops_per_device": 1e-7, "mfu": 0.5,
        "mfu_above_peak": False}
    assert derived_metrics(1000, 1.0, 1, 100, None)["mfu_above_peak"] is None


def test_one_cpu_peak_per_sweep_run(tmp_path, monkeypatch):
    """Inside a sweep every point reads the run's one calibration (per thread count) and its dtype, so
    MFU is comparable across its points; the first to calibrate writes it, the others only read."""
    calls = []
    monkeypatch.setattr(flops, "calibrate_cpu_peak", lambda: (calls.append(1) or 1.0e11 * len(calls), "bf16"))
    monkeypatch.setenv(CPU_PEAK_FILE_ENV, str(tmp_path / "cpu_peak"))
    first, second = flops.device_peak(torch.device("cpu")), flops.device_peak(torch.device("cpu"))
    assert first == second and first.flops == 1.0e11 and first.dtype == "bf16" and len(calls) == 1
    assert "calibration bf16 matmul" in first.source and "one per sweep run" in first.source
    path = tmp_path / f"cpu_peak_t{torch.get_num_threads()}.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    path.write_text(json.dumps({"peak_flops": 5.0e10, "threads": 1}))  # stored before the dtype was
    assert flops.device_peak(torch.device("cpu"))[:2] == (5.0e10, "fp32")
    monkeypatch.delenv(CPU_PEAK_FILE_ENV)
    assert flops.device_peak(torch.device("cpu")).flops == 2.0e11  # outside a sweep: its own calibration
