"""The command line: bad input gives one clear line and a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest


def moebench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moebench.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--set", "moe.top_k=9"], "moe.top_k=9 exceeds moe.num_experts=8"),
        (["train", "--set", "model.n_heads=3"], "does not divide model.d_model"),
        (["train", "--preset", "gpt5"], "unknown preset 'gpt5'"),
        (["train", "--set", "moe.experts=4"], "unknown key 'moe.experts'"),
        (["train", "--set", "moe.top_k=four"], "bad value 'four' for moe.top_k"),
        (["plan", "--set", "train.steps=-1"], "train.steps=-1 must be >= 1"),
    ],
)
def test_bad_input_is_one_line(args, message):
    result = moebench(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_train_json_last_line_is_the_record():
    result = moebench("train", "--preset", "tiny", "--steps", "3", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["status"] == "ok" and record["timed_steps"] == 1
    assert record["config"]["train"]["steps"] == 3


def test_train_human_summary():
    result = moebench("train", "--preset", "tiny", "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout and "MFU" in result.stdout


def test_plan_is_instant_for_the_largest_preset():
    result = moebench("plan", "--preset", "ultra-2.38t", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["total_params"] == pytest.approx(2.38e12, rel=0.03)
