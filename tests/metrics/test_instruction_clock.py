"""The instruction clock (train.instructions): each timed step's instructions counted by valgrind's callgrind,
folded and judged over runs as the other clocks are. The real counter needs valgrind (skipped without it)."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from report_helpers import edited_store, fixture_store, repeated_store

from moebench.errors import ConfigError
from moebench.metrics import instructions
from moebench.metrics.timer import StepTimer
from moebench.presets import load_config
from moebench.report.build import load_tables
from moebench.results.stats import metric_ratio
from moebench.results.table import by_point

SMOKE = fixture_store("smoke")


class FakeCounter:
    """Counts 1e9 more instructions each stop, as callgrind would report a step's."""

    def __init__(self) -> None:
        self.started = 0
        self.stops = 0

    def start(self) -> None:
        self.started += 1

    def stop(self) -> int:
        self.stops += 1
        return self.stops * 10**9


def test_the_timer_counts_only_the_timed_steps():
    counter = FakeCounter()
    timer = StepTimer(torch.device("cpu"), warming=True, instructions=counter)
    timer.start()
    timer.stop()  # a warm-up step: not counted, instrumentation not even started
    assert counter.started == 0 and timer.ginstruction_samples == []
    timer.end_warmup()
    for _ in range(2):
        timer.start()
        timer.stop()
    assert timer.ginstruction_samples == [1.0, 2.0] and len(timer.samples) == 2


def test_a_callgrind_dump_total_is_read(tmp_path):
    dump = tmp_path / "callgrind.123.1"
    dump.write_text("# callgrind format\nversion: 1\nevents: Ir\nfn=(1) main\n0 42\ntotals: 9385877\n")
    assert instructions.dump_total(dump) == 9385877
    (tmp_path / "bad").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no totals line"):
        instructions.dump_total(tmp_path / "bad")


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.instructions=true", "train.device=cpu"], "train.instructions=true needs train.cpu_threads=1 (got 0)"),
    (["train.instructions=true", "train.device=cuda", "train.cpu_threads=1"], "train.device=cuda must be cpu"),
])
def test_instructions_need_one_cpu_thread(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", overrides)


def test_a_counter_outside_callgrind_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv(instructions.CALLGRIND_OUT_ENV, raising=False)
    with pytest.raises(ConfigError, match="does not run under callgrind"):
        instructions.InstructionCounter()


def test_tokens_per_ginstruction_is_judged_on_the_instruction_counts():
    """Equal wall times, 10% more instructions a step, counts steady to 0.1%: the instruction clock says 1/1.1
    with an interval that excludes 1, with 2 runs a side; the wall clock sees nothing."""
    def row(g):
        return {"tokens_per_step": 1000, "world_size": 1, "step_runs": [[0.1] * 5] * 2,
                "instruction_step_runs": [[g, g * 1.001, g, g * 0.999, g]] * 2}
    base, slow = row(0.300), row(0.330)
    ratio = metric_ratio(slow, base, "tokens_per_ginstruction")
    assert ratio.value == pytest.approx(1 / 1.1, rel=1e-3) and ratio.verdict == "slower" and ratio.high < 0.95
    assert metric_ratio(slow, base, "tokens_per_s").value == pytest.approx(1.0)


def test_a_point_folds_its_runs_instruction_counts(tmp_path):
    counts = {0: [0.30] * 5, 1: [0.31] * 5, 2: [0.32] * 5}
    store = edited_store(repeated_store(SMOKE, tmp_path / "three", 3), tmp_path / "s",
                         lambda r: {**r, "step_ginstructions": counts[r["repeat"]]})
    row = by_point(load_tables([store])[0]).iloc[0]
    assert row["instruction_step_runs"] == [counts[0], counts[1], counts[2]]
    assert row["tokens_per_ginstruction"] == pytest.approx(row["tokens_per_step"] / 0.31)
    old = by_point(load_tables([repeated_store(SMOKE, tmp_path / "old", 3)])[0])
    assert old["tokens_per_ginstruction"].isna().all()  # records from before the clock: no rate


SCRIPT = textwrap.dedent("""
    import torch
    from moebench.metrics.instructions import InstructionCounter
    torch.set_num_threads(1)
    a = torch.ones(64, 64)
    counter = InstructionCounter()
    for _ in range(20):
        a = torch.mm(a, a).clamp_(max=1.0)
    counts = []
    for n in (20, 20, 40):
        counter.start()
        for _ in range(n):
            a = torch.mm(a, a).clamp_(max=1.0)
        counts.append(counter.stop())
    counter.finish()
    print(counts)
""")


@pytest.mark.slow
@pytest.mark.skipif(instructions.valgrind_missing() is not None, reason="needs valgrind (apt-get install valgrind)")
def test_callgrind_counts_the_same_work_alike_and_twice_the_work_twice(tmp_path):
    """The real counter, under the command line the trainer runs under, after an uncounted warm-up as the
    trainer's: 20 matmuls count nearly the same instructions twice (the clock's point), 40 twice as many
    (it counts work). Measured: repeats within 0.05%, double 1.998-1.999x (3 runs). Without the warm-up
    the first counted block carries torch's first-call costs, about 1% more."""
    argv, env = instructions.callgrind_command(tmp_path)
    done = subprocess.run([*argv, sys.executable, "-c", SCRIPT], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stderr, (tmp_path / "valgrind.log").read_text()[-2000:])
    first, again, double = eval(done.stdout.strip().splitlines()[-1])
    assert first > 0 and abs(again / first - 1) < 0.002
    assert 1.98 < double / first < 2.02
