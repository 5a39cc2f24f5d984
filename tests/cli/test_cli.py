"""The command line: bad input gives one clear line and a non-zero exit, never a traceback."""

import json
import os
import subprocess
import sys

import pytest


def moebench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moebench.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--set", "moe.top_k=9"], "moe.top_k=9 exceeds moe.num_experts=8"),
        (["train", "--set", "model.n_heads=3"], "does not divide model.d_model"),
        (["train", "--preset", "gpt5"], "unknown preset 'gpt5'"),
        (["train", "--set", "moe.experts=4"], "unknown key 'moe.experts'"),
        (["train", "--set", "moe.top_k=four"], "bad value 'four' for moe.top_k"),
        (["plan", "--set", "train.steps=-1"], "train.steps=-1 must be >= 1"),
        (["train", "--set", "train.lr=-1"], "train.lr=-1.0 must be >= 0"),
        # one rank is a layout too: ep=2 must not train unsharded under an EP label
        (["train", "--set", "parallel.ep=2"], "parallel.ep=2 does not divide parallel.dp=1"),
        (["plan", "--gpus", "8", "--matmul-efficiency", "0"], "--matmul-efficiency 0.0: must be a share"),
        (["plan", "--gpus", "8", "--matmul-efficiency", "nan"], "--matmul-efficiency nan: must be a share"),
        (["plan", "--gpus", "8", "--mem-reserve", "1.5"], "--mem-reserve 1.5: must be a share of HBM in [0, 1)"),
        (["plan", "--gpus", "8", "--search", "--top", "0"], "--top 0: must be >= 1"),
    ],
)
def test_bad_input_is_one_line(args, message):
    result = moebench(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,message",
    [
        # each of these was a traceback (or, for --out, a result lost after the benchmark ran)
        (["bench", "moe-layer", "--tokens", "0"], "Invalid value for '--tokens': 0 is not in the range x>=1"),
        (["bench", "moe-layer", "--experts", "0", "--top-k", "0"], "'--experts': 0 is not in the range x>=1"),
        (["bench", "moe-layer", "--repeats", "0"], "'--repeats': 0 is not in the range x>=1"),
        (["bench", "e2e", "--warmup", "-1"], "'--warmup': -1 is not in the range x>=0"),
        (["bench", "moe-layer", "--out", "/no/such/folder/r.json"], "--out /no/such/folder/r.json: folder "
                                                                    "/no/such/folder does not exist"),
        (["bench", "moe-layer", "--tokens", "100000000", "--d-model", "100000", "--repeats", "1", "--no-loop"],
         "needs at least 600,624.1 GiB for its routed rows or its experts' weights, more than this machine's"),
        # 100000 gloo ranks on this machine's CPUs
        (["train", "--nproc", "100000", "--set", "parallel.dp=100000", "--set", "train.micro_batch_size=1",
          "--set", "train.global_batch_size=100000"], "--nproc 100000: more ranks than the"),
    ],
)
def test_bad_bench_and_rank_options_are_one_line(args, message, monkeypatch, capsys):
    """In-process (the real entry point, no subprocess): these start torch work once past the checks."""
    from report_helpers import run_cli

    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("args", [["report", "{}"], ["report", "{}", "-o", "{}"], ["check", "{}", "{}"],
                                  ["check", "{}", "--ratio", "ddp/fsdp:tokens_per_s>=1"], ["status", "{}"]])
def test_a_store_path_that_does_not_exist_is_one_line(tmp_path, args):
    missing = tmp_path / "no-such-run"
    result = moebench(*(a.format(missing) for a in args))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and str(missing) in result.stderr
    assert "Traceback" not in result.stderr and "Usage:" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not missing.exists()


@pytest.mark.slow
def test_train_json_last_line_is_the_record_with_its_environment_and_mllog(tmp_path):
    from mllog_helpers import check

    env = {**os.environ, "NCCL_ALGO": "Ring", "TORCH_NCCL_BLOCKING_WAIT": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           "MY_API_TOKEN": "secret"}
    result = moebench("train", "--preset", "tiny", "--steps", "3", "--json", "--mllog", str(tmp_path / "run.mllog"),
                      env=env)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["status"] == "ok" and record["timed_steps"] == 1
    assert record["config"]["train"]["steps"] == 3
    # the comparability facts: only NCCL_/TORCH_/CUDA_ variables; on this CPU machine no GPU facts
    assert {"NCCL_ALGO": "Ring", "TORCH_NCCL_BLOCKING_WAIT": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}.items() \
        <= record["env_vars"].items()
    assert "MY_API_TOKEN" not in record["env_vars"] and "secret" not in result.stdout
    assert record["versions"]["torch"] and record["driver_version"] is None and record["gpu_settings"] is None
    assert check(tmp_path / "run.mllog") == (True, [])


@pytest.mark.slow
def test_train_human_summary():
    result = moebench("train", "--preset", "tiny", "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout and "MFU" in result.stdout


@pytest.mark.slow
def test_plan_is_instant_for_the_largest_preset():
    result = moebench("plan", "--preset", "ultra-2.38t", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["total_params"] == pytest.approx(2.38e12, rel=0.03)


@pytest.mark.slow
def test_bad_suite_file_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: s\ngrid: {moe.num_experts: [8, many]}\n")
    result = moebench("run", str(path), "--out", str(tmp_path / "st"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == f"error: {path}: grid.moe.num_experts[1]: bad value 'many' for moe.num_experts; " \
        "expected an integer\n"
    path.write_text("name: s\ngrid: {moe.num_experts: [8, 16]\n")
    result = moebench("run", str(path), "--dry-run")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {path}:3:1: not valid YAML: ")
    assert not (tmp_path / "st").exists()


@pytest.mark.slow
def test_env_reports_devices_precision_paths_nvml_and_slurm(monkeypatch):
    """`moebench env` on this CPU machine, then with a stand-in SM90 GPU and a scripted NVML."""
    import types

    import torch
    from nvml_helpers import FakeNvml

    from moebench.kernels import quantized
    from moebench.metrics.environment import environment, environment_lines

    result = moebench("env", "--json")
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout.strip().splitlines()[-1])
    assert env["devices"][0]["device"] == "cpu"
    assert env["devices"][0]["precision_impl"] == {"bf16": "native", "fp8": "emulated", "mxfp8": "emulated"}

    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(quantized, "_native_status",  # what the probe finds on SM90
                        lambda fmt, index, kind: None if fmt == "fp8" else "compute capability 9.0 < 10.0")
    monkeypatch.setattr(torch.cuda, "nccl", None, raising=False)
    env = environment(nvml=FakeNvml(["GPU-a"]))
    gpu = env["devices"][1]
    assert (gpu["device"], gpu["capability"], gpu["memory_gib"]) == ("cuda:0", "9.0", 141.0)
    assert gpu["precision_impl"] == {"bf16": "native", "fp8": "native", "mxfp8": "emulated"}
    assert env["nvml"]["available"] and len(env["nvml"]["gpus"]) == 1
    lines = environment_lines(env)
    assert any(line.startswith("cuda:0") and "fp8 native, mxfp8 emulated" in line for line in lines)
    assert "nvml     available, 1 GPU(s)" in lines
    # what a run record would keep of this environment
    assert "driver   570.1 (CUDA 12.8)" in lines
    assert "gpu0     power limit 700 W (enforced 650 W), application clocks SM 1755 MHz / memory 2619 MHz, " \
        "NVLinks active -" in lines
    linked = FakeNvml(["GPU-a"])
    linked.nvlinks, linked.nvlinks_down = {"GPU-a": 18}, {"GPU-a": {5, 9}}
    assert any(line.endswith("NVLinks active 16 (links 5, 9 down)") for line in environment_lines(environment(linked)))
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("SOME_TOKEN", "secret")
    env_line = next(line for line in environment_lines(environment()) if line.startswith("env "))
    assert "NCCL_ALGO=Ring" in env_line and "secret" not in env_line
