"""NVML sampler driven by a fake NVML library; the real one on a GPU machine."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from nvml_helpers import FakeNvml

from moebench.metrics.environment import env_vars, gpu_topology, run_environment
from moebench.metrics.host import run_metadata
from moebench.metrics.nvml import (
    DEVICE_FIELDS,
    NULL_FIELDS,
    NULL_SETTINGS,
    NvmlSampler,
    device_totals,
    gpu_settings,
    list_gpus,
    normalize_uuid,
    torch_device_uuids,
)


class NoDriver:
    def nvmlInit(self):
        raise RuntimeError("NVML Shared Library Not Found")


def test_devices_matched_by_uuid_not_index():
    fake = FakeNvml(["GPU-aaaa", "GPU-bbbb"], mem={"GPU-aaaa": [1], "GPU-bbbb": [7, 9, 8]})
    # torch reports UUIDs without the GPU- prefix; CUDA_VISIBLE_DEVICES may reorder them
    sampler = NvmlSampler(["BBBB"], nvml=fake)
    assert [d.uuid for d in sampler.devices] == ["BBBB"]
    for _ in range(3):
        sampler.sample_once()
    assert sampler.summary()["nvml_peak_mem_used_bytes"] == 9
    assert fake.calls["GPU-aaaa"] == 0
    assert fake.mem_versions == {FakeNvml.nvmlMemory_v2}
    with pytest.raises(ValueError, match="no device with UUID cccc"):
        NvmlSampler(["cccc"], nvml=FakeNvml(["GPU-aaaa"]))


def test_window_energy_clocks_and_throttle_flag():
    fake = FakeNvml(["GPU-a", "GPU-b"], clocks={"GPU-a": [1980, 1500, 1700], "GPU-b": [1980]},
                    reasons={"GPU-a": 0x1 | 0x40, "GPU-b": 0x1}, energy_step_mj=2500)
    sampler = NvmlSampler(["GPU-a", "GPU-b"], nvml=fake)
    sampler.sample_once()  # before the window: memory only
    sampler.window_start()
    sampler.sample_once()
    sampler.window_end()
    out = sampler.summary()
    assert out["nvml_energy_j"] == pytest.approx(2 * 2.5)  # each device's counter moved 2500 mJ
    a, b = out["nvml_devices"]
    assert a["throttle_reasons"] == ["gpu_idle", "hw_thermal_slowdown"] and a["throttled"]
    assert b["throttle_reasons"] == ["gpu_idle"] and not b["throttled"]  # idle is not a limit
    assert out["throttled"] and out["nvml_throttle_reasons"] == ["gpu_idle", "hw_thermal_slowdown"]
    assert a["sm_clock_mhz_min"] == 1500 and out["nvml_samples"] == 4


def test_thread_samples_and_stop_shuts_down():
    fake = FakeNvml(["GPU-a"], mem={"GPU-a": [1, 5, 3]})
    sampler = NvmlSampler(["GPU-a"], interval_s=0.01, nvml=fake).start()
    sampler.window_start()
    deadline = time.time() + 10
    while sampler.samples < 5 and time.time() < deadline:
        time.sleep(0.01)
    sampler.window_end()
    out = sampler.stop()
    assert out["nvml_samples"] >= 5 and out["nvml_peak_mem_used_bytes"] == 5
    assert out["nvml_interval_s"] == 0.01 and 0 <= out["nvml_overhead_fraction"] < 1
    assert fake.shutdowns == 1 and not sampler._thread.is_alive()


def test_without_nvml_fields_are_null():
    sampler = NvmlSampler(["GPU-a"], nvml=NoDriver()).start()
    sampler.window_start()
    sampler.window_end()
    assert sampler.stop() == NULL_FIELDS
    assert list_gpus(NoDriver()) == []


def test_cpu_device_sampler_is_null():
    sampler = NvmlSampler.for_torch_device(torch.device("cpu")).start()
    sampler.window_start()
    sampler.window_end()
    assert sampler.stop() == NULL_FIELDS and not sampler.available


def test_list_gpus_and_metadata_with_fake():
    gpus = list_gpus(FakeNvml(["GPU-a"]))
    assert gpus == [{"name": "NVIDIA H200", "uuid": "GPU-a", "driver": "570.1", "memory_total_bytes": 141 << 30}]
    meta = run_metadata(FakeNvml(["GPU-a"]))
    assert meta["host"]["gpus"][0]["uuid"] == "GPU-a" and meta["host"]["nodes"] >= 1
    assert meta["versions"]["torch"] == torch.__version__ and meta["host"]["cpu_model"]
    assert normalize_uuid(b"GPU-ABC") == "abc" and normalize_uuid("MIG-x") == "x"


def test_gpu_settings_driver_power_clocks_and_nvlinks_with_fake():
    fake = FakeNvml(["GPU-a", "GPU-b"])
    fake.nvlinks = {"GPU-a": 18}  # GPU-b answers for no link: PCIe only
    out = gpu_settings(fake)
    assert out["driver_version"] == "570.1" and out["cuda_driver_version"] == "12.8"
    a, b = out["gpu_settings"]
    assert a == {"index": 0, "uuid": "GPU-a", "name": "NVIDIA H200", "power_limit_w": 700.0,
                 "enforced_power_limit_w": 650.0, "application_sm_clock_mhz": 1755,
                 "application_mem_clock_mhz": 2619, "nvlinks_active": 18, "nvlink_up": [True] * 18}
    assert b["nvlinks_active"] is None and b["nvlink_up"] is None and fake.shutdowns == fake.inited == 1
    fake.app_clocks_supported = False  # a GPU that does not report a fact: that fact is None, not an error
    assert gpu_settings(fake)["gpu_settings"][0]["application_sm_clock_mhz"] is None
    assert gpu_settings(NoDriver()) == NULL_SETTINGS == dict.fromkeys(NULL_SETTINGS)


def test_run_environment_keeps_nccl_torch_cuda_variables_topology_and_settings(tmp_path, monkeypatch):
    environ = {"NCCL_IB_HCA": "mlx5_0", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "CUDA_VISIBLE_DEVICES": "0,1",
               "AWS_SECRET_ACCESS_KEY": "x", "HF_TOKEN": "y", "NCCLX": "z", "PATH": "/bin"}
    assert env_vars(environ) == {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_IB_HCA": "mlx5_0",
                                 "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1 $2\" = 'topo -m' ] || exit 3\nprintf '\tGPU0\tGPU1\nGPU0\t X \tNV18\n'\n")
    smi.chmod(0o755)
    assert gpu_topology(str(smi)) == "\tGPU0\tGPU1\nGPU0\t X \tNV18"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert gpu_topology(str(smi)) is None and gpu_topology(str(tmp_path / "absent")) is None
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no nvidia-smi on PATH
    fake = FakeNvml(["GPU-a"])
    out = run_environment(fake)
    assert out["env_vars"]["NCCL_PROTO"] == "Simple" and out["versions"]["torch"] == torch.__version__
    assert out["gpu_topology"] is None and out["gpu_settings"][0]["power_limit_w"] == 700.0
    # a rank other than 0 (its record is not kept) asks neither nvidia-smi nor NVML
    monkeypatch.setattr(shutil, "which", lambda name: str(smi))
    inited = fake.inited
    rest = run_environment(fake, gpus=False)
    assert rest["env_vars"] == out["env_vars"] and rest["gpu_topology"] is None and rest["gpu_settings"] is None
    assert rest["driver_version"] is None and fake.inited == inited


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and NVML")
def test_real_nvml_sees_allocation_and_overhead():
    assert torch_device_uuids([0])
    sampler = NvmlSampler.for_torch_device(torch.device("cuda", 0)).start()  # default interval
    sampler.window_start()
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # 2 GiB
    a = torch.randn(8192, 8192, device="cuda")
    t0 = time.perf_counter()
    for _ in range(500):
        a = a @ a
        a = a / a.norm()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    sampler.window_end()
    out = sampler.stop()
    del x
    assert out["nvml_peak_mem_used_bytes"] >= 2 << 30
    assert out["nvml_sm_clock_mhz_median"] > 0 and out["nvml_samples"] >= 2
    assert out["nvml_energy_j"] is None or out["nvml_energy_j"] >= 0
    # the sampler's busy time stays under 1% of the wall time it covered
    assert out["nvml_overhead_fraction"] < 0.01, (out["nvml_overhead_fraction"], elapsed)
    assert list_gpus()[0]["uuid"]


def test_tokens_per_joule_from_the_timed_window_energy(monkeypatch):
    """A run whose (scripted) NVML counter moves 2 J over the timed window: tokens per joule is the
    tokens of the timed steps over those 2 J; on CPU, without NVML, it is None."""
    from moebench.presets import load_config
    from moebench.record import METRICS
    from moebench.train import run

    cfg = load_config("tiny", ["train.steps=3", "train.warmup_steps=1"])
    assert run.run_training(cfg)["tokens_per_joule"] is None
    monkeypatch.setattr(run.NvmlSampler, "for_torch_device", classmethod(
        lambda cls, device: cls(["GPU-a"], 0.01, nvml=FakeNvml(["GPU-a"], energy_step_mj=2000))))
    record = run.run_training(cfg)
    assert record["nvml_energy_j"] == pytest.approx(2.0)  # window_start and window_end read the counter once each
    assert record["tokens_per_joule"] == pytest.approx(cfg.tokens_per_step * 2 / 2.0)
    assert METRICS["tokens_per_joule"].direction == "higher"


def test_device_totals_over_gpus():
    """Peak: max; energy: sum, unknown if one GPU has no counter; clock: median of medians."""
    def gpu(peak, energy, clock, reasons=()):
        return {"peak_mem_used_bytes": peak, "energy_j": energy, "sm_clock_mhz_median": clock,
                "throttle_reasons": list(reasons), "throttled": "hw_slowdown" in reasons}

    out = device_totals([gpu(3, 1.5, 1900), gpu(5, 2.0, 1700, ["hw_slowdown"]), gpu(4, 0.5, 1800)])
    assert out["nvml_peak_mem_used_bytes"] == 5 and out["nvml_energy_j"] == pytest.approx(4.0)
    assert out["nvml_sm_clock_mhz_median"] == 1800 and out["throttled"]
    assert out["nvml_throttle_reasons"] == ["hw_slowdown"] and len(out["nvml_devices"]) == 3
    assert device_totals([gpu(3, 1.5, 1900), gpu(5, None, 1700)])["nvml_energy_j"] is None  # pre-Volta GPU
    assert device_totals([]) == {key: NULL_FIELDS[key] for key in DEVICE_FIELDS}


def _two_node_record(scripted: bool) -> dict:
    """One of two gloo ranks, each on its own (pretend) node with its own scripted GPU: rank r's
    memory peaks at r+1 GiB, its energy counter moves (r+1) J per read and rank 1 throttles."""
    import os

    from moebench.presets import load_config
    from moebench.train import run

    rank = int(os.environ["RANK"])
    os.environ["SLURMD_NODENAME"] = f"node{rank}"  # node_name()'s Slurm seam: each rank its own node
    if scripted:
        uuid = f"GPU-{rank}"
        fake = FakeNvml([uuid], mem={uuid: [(rank + 1) << 30]}, reasons={uuid: 0x40 * rank},
                        energy_step_mj=1000 * (rank + 1))
        run.NvmlSampler.for_torch_device = classmethod(lambda cls, device: cls([uuid], 0.01, nvml=fake))
    return run.run_training(load_config("tiny", ["train.steps=3", "train.warmup_steps=1", "parallel.dp=2"]))


@pytest.mark.slow
def test_nvml_figures_from_every_node():
    """The record's NVML figures combine both nodes' GPUs (peak: max, energy: sum) and each
    node's entry carries its own GPU's; tokens per joule divides every GPU's tokens by the sum."""
    from moebench.testing import run_distributed

    record = run_distributed(_two_node_record, 2, True)[0]
    one, two = record["nodes"]
    assert (one["node"], one["ranks"], two["node"], two["ranks"]) == ("node0", [0], "node1", [1])
    assert [g["uuid"] for g in one["nvml_devices"]] == ["GPU-0"] and one["nvml_devices"][0]["rank"] == 0
    assert one["nvml_peak_mem_used_bytes"] == 1 << 30 and two["nvml_peak_mem_used_bytes"] == 2 << 30
    assert one["nvml_energy_j"] == pytest.approx(1.0) and two["nvml_energy_j"] == pytest.approx(2.0)
    assert not one["throttled"] and two["throttled"] and two["nvml_throttle_reasons"] == ["hw_thermal_slowdown"]
    assert record["nvml_peak_mem_used_bytes"] == 2 << 30 and record["nvml_energy_j"] == pytest.approx(3.0)
    assert record["throttled"] and [g["uuid"] for g in record["nvml_devices"]] == ["GPU-0", "GPU-1"]
    assert record["tokens_per_joule"] == pytest.approx(record["tokens_per_step"] * 2 / 3.0)

    bare = run_distributed(_two_node_record, 2, False)[0]  # CPU, no NVML: every figure stays None
    assert [n["node"] for n in bare["nodes"]] == ["node0", "node1"]
    for entry in (bare, *bare["nodes"]):
        assert entry["nvml_energy_j"] is None and entry["nvml_peak_mem_used_bytes"] is None
        assert entry["nvml_devices"] is None and entry["throttled"] is None
    assert bare["tokens_per_joule"] is None


def test_finished_point_line_names_the_nodes_that_throttled():
    from moebench.sweep.progress import summary_line

    nodes = [{"node": "node0", "throttled": False}, {"node": "node1", "throttled": True}]
    assert summary_line({"status": "ok", "throttled": True, "nodes": nodes}).endswith("THROTTLED on node1")
    assert summary_line({"status": "ok", "throttled": True, "nodes": nodes[1:]}).endswith("THROTTLED")
    assert "THROTTLED" not in summary_line({"status": "ok", "throttled": False, "nodes": nodes[:1]})
    assert summary_line({"status": "ok", "throttled": True}).endswith("THROTTLED")  # records from before nodes


def test_each_nvlink_state_is_recorded_by_link_number():
    fake = FakeNvml(["GPU-a", "GPU-b"])
    fake.nvlinks, fake.nvlink_count, fake.nvlinks_down = {"GPU-a": 18, "GPU-b": 12}, {"GPU-b": 12}, {"GPU-a": {5}}
    a, b = gpu_settings(fake)["gpu_settings"]
    assert a["nvlinks_active"] == 17 and a["nvlink_up"] == [i != 5 for i in range(18)]
    assert b["nvlinks_active"] == 12 and b["nvlink_up"] == [True] * 12  # links past its 12th are none of its own


def _interconnect_store(src, dst, fake, environ):
    """A copy of ``src`` whose records carry what run_environment reads from ``fake`` and ``environ``."""
    from report_helpers import edited_store

    settings = gpu_settings(fake)
    return edited_store(src, dst, lambda r: {**r, **settings, "env_vars": env_vars(environ)})


def test_check_names_a_change_of_nvlinks_or_nccl_settings_as_the_environments(tmp_path, monkeypatch, capsys):
    from report_helpers import fixture_store, run_cli

    from moebench.report.gate.check import environment_warnings
    from moebench.report.gate.interconnect import interconnect_warnings
    from moebench.results.table import load_tables

    gpus = [f"GPU-{i}" for i in range(8)]
    healthy, broken = FakeNvml(gpus), FakeNvml(gpus)
    healthy.nvlinks = broken.nvlinks = dict.fromkeys(gpus, 18)
    broken.nvlinks_down = {"GPU-3": {5}}
    smoke = fixture_store("smoke")
    nccl = {"NCCL_IB_HCA": "mlx5_0"}
    base = load_tables([_interconnect_store(smoke, tmp_path / "base", healthy, nccl)])[0]
    same = load_tables([_interconnect_store(smoke, tmp_path / "same", healthy, nccl)])[0]
    down = load_tables([_interconnect_store(smoke, tmp_path / "down", broken, nccl)])[0]
    capped = load_tables([_interconnect_store(smoke, tmp_path / "capped", healthy,
                                              {**nccl, "NCCL_MAX_NCHANNELS": "4"})])[0]
    assert interconnect_warnings(base, same) == []
    (line,) = interconnect_warnings(base, down)
    assert line.startswith("environment changed between BASELINE and CURRENT: NVLink links up 18 -> 17 on GPU 3 "
                           "(link 5 down): ") and "interconnect's, not the code's" in line
    assert "GPU 2" not in line and line in environment_warnings(base, down, [], [])
    (back,) = interconnect_warnings(down, base)
    assert "NVLink links up 17 -> 18 on GPU 3 (link 5 up)" in back
    (line,) = interconnect_warnings(base, capped)
    assert "NCCL_MAX_NCHANNELS unset -> 4" in line and "NVLink" not in line and "NCCL_IB_HCA" not in line
    # CPU records (no NVML, no NCCL variables) compare without a word
    assert interconnect_warnings(load_tables([smoke])[0], load_tables([smoke])[0]) == []
    # moebench check says it among its warnings
    _, _, err = run_cli(["check", str(tmp_path / "base"), str(tmp_path / "down")], monkeypatch, capsys)
    assert "warning: environment changed between BASELINE and CURRENT: NVLink links up 18 -> 17 on GPU 3" in err


def test_damaged_interconnect_fields_are_left_out_not_a_traceback(tmp_path):
    from report_helpers import edited_store, fixture_store

    from moebench.report.gate.interconnect import interconnect_warnings
    from moebench.results.table import load_tables

    smoke = fixture_store("smoke")
    good = [{"index": 0, "nvlinks_active": 18, "nvlink_up": [True] * 18}]
    base = load_tables([edited_store(smoke, tmp_path / "b", lambda r: {**r, "gpu_settings": good})])[0]
    for n, bad in enumerate(["x", {"index": 0}, [None, 3, {"index": "0", "nvlinks_active": 17}],
                             [{"index": 0, "nvlinks_active": True, "nvlink_up": "up"}],
                             [{"index": 0, "nvlinks_active": 17, "nvlink_up": {"5": False}}]]):
        cur = load_tables([edited_store(smoke, tmp_path / f"c{n}", lambda r, bad=bad: {
            **r, "gpu_settings": bad, "env_vars": {"NCCL_ALGO": ["Ring"]}})])[0]
        lines = interconnect_warnings(base, cur)
        assert len(lines) == 1 and "NCCL_ALGO unset -> ['Ring']" in lines[0], (bad, lines)
        assert ("18 -> 17 on GPU 0" in lines[0]) == (n == 4), lines  # the count read where the links are not
