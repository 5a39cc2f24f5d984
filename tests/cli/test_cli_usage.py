"""How the command line reads: help, usage errors, option hints, progress and summaries."""

import re

import click
import pytest
from click.testing import CliRunner
from report_helpers import run_cli

from moebench.cli import cli


def _groups(group: click.Group, prefix: list[str]) -> list[list[str]]:
    found = [prefix]
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += _groups(command, [*prefix, name])
    return found


@pytest.mark.parametrize("args", _groups(cli, []))
def test_command_summaries_are_whole_at_80_columns(args):
    result = CliRunner().invoke(cli, [*args, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    commands = result.output.split("Commands:\n")[1].splitlines()
    assert commands and all("..." not in line and len(line) <= 80 for line in commands), commands


@pytest.mark.parametrize("args,message", [
    (["train", "--bogus"], "error: No such option '--bogus'; see 'moebench train --help'"),
    (["--bogus"], "error: No such option '--bogus'; see 'moebench --help'"),
    (["status"], "error: Missing argument 'RUN'; see 'moebench status --help'"),
    (["bench", "moe-layer", "--tokens", "x"], "error: Invalid value for '--tokens': 'x' is not a valid integer range; "
                                              "see 'moebench bench moe-layer --help'"),
    (["check", "a", "b", "c"], "error: give at most two stores: BASELINE CURRENT; see 'moebench check --help'"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message, monkeypatch, capsys):
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert (code, out, err) == (2, "", message + "\n")


def test_bare_moebench_prints_help_and_exits_0(monkeypatch, capsys):
    code, out, err = run_cli([], monkeypatch, capsys)
    assert code == 0 and out.startswith("Usage: moebench [OPTIONS] COMMAND") and "train" in out and not err


@pytest.mark.parametrize("args,message", [
    (["train", "--set", "preset=tiny"], "unknown key 'preset': preset is not a config field; use --preset tiny"),
    (["train", "--set", "nproc=2"], "use --nproc 2 (train) or --gpus 2 (plan)"),
    (["plan", "--set", "steps=3"], "use --set train.steps=3 (train: --steps 3)"),
    (["plan", "--set", "num_experts=4"], "unknown key 'num_experts': did you mean moe.num_experts?"),
    (["run", "smoke", "--dry-run", "--set", "preset=tiny"], "--set preset=tiny: preset is not a config field; "
                                                            "the suite sets it (base.preset, or an axis"),
    (["run", "smoke", "--dry-run", "--set", "steps=2"], "--set steps=2: unknown key 'steps'; did you mean "
                                                        "train.steps?"),
])
def test_a_set_key_that_is_an_option_says_which_option(args, message, monkeypatch, capsys):
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert "allowed: preset" not in err


def test_steps_shrinks_the_default_warm_up(monkeypatch, capsys):
    import moebench.record
    import moebench.train.run

    seen = []
    monkeypatch.setattr(moebench.train.run, "run_training", lambda cfg, log: seen.append(cfg) or {"status": "ok"})
    monkeypatch.setattr(moebench.record, "to_json_line", lambda record: "{}")
    code, _, err = run_cli(["train", "--steps", "1", "--json"], monkeypatch, capsys)
    assert code == 0, err
    assert (seen[0].train.steps, seen[0].train.warmup_steps) == (1, 0)
    # a warm-up given explicitly is kept, and refused when it leaves nothing to time
    code, _, err = run_cli(["train", "--steps", "1", "--set", "train.warmup_steps=1"], monkeypatch, capsys)
    assert code == 2 and "train.warmup_steps=1 must be in [0, train.steps=1)" in err


def test_config_and_layout_errors_are_reported_together(monkeypatch, capsys):
    code, _, err = run_cli(["train", "--set", "train.lr=-1", "--set", "parallel.ep=2"], monkeypatch, capsys)
    assert code == 2
    assert err == ("error: train.lr=-1.0 must be >= 0; impossible parallel layout: parallel.ep=2 does not divide "
                   "parallel.dp=1 (EP is carved out of the data-parallel ranks; ep could be 1)\n")


def _commands(group: click.Group):
    for command in group.commands.values():
        yield from _commands(command) if isinstance(command, click.Group) else [command]


def test_help_examples_with_a_comparison_are_quoted():
    """Pasted into bash, an unquoted tokens_per_s>=1.0 silently writes a file named =1.0."""
    texts = [p.help or "" for c in _commands(cli) for p in c.params if isinstance(p, click.Option)]
    texts += [c.help or "" for c in _commands(cli)]
    examples = [m for text in texts for m in re.findall(r"\S*[<>]=\S*", text)]
    assert examples and all(m.startswith("'") for m in examples), examples


def test_run_lines_are_aligned_fit_80_columns_and_give_the_ratio_to_the_baseline():
    from moebench.sweep.progress import SUMMARY_HEADER, Progress

    lines = []
    with Progress(3, enabled=False, echo=lines.append, baseline={"parallel.strategy": "fsdp"},
                  width=lambda: 80) as bar:
        for i, (strategy, rate) in enumerate([("fsdp", 1234.0), ("ddp", 1500.0), ("ddp-rowwise", 2e6)]):
            bar.finished({"point_id": f"p00{i}", "status": "ok", "tokens_per_s_per_device": rate,
                          "point": {"moe.num_experts": 64, "parallel.strategy": strategy, "moe.top_k": 8},
                          "peak_mem_bytes": 12345 * 2**20, "point_wall_s": 1234.5})
        bar.finished({"point_id": "p003", "status": "failed", "point": {"moe.num_experts": 8},
                      "error": "exit code 1: " + "x" * 200})
    assert lines[0] == SUMMARY_HEADER and len(lines) == 5
    assert all(len(line) <= 80 for line in lines)
    assert lines[1].split()[:6] == ["p000", "ok", "1,234", "base", "12,345", "1234s"]
    assert lines[2].split()[:6] == ["p001", "ok", "1,500", "1.22x", "12,345", "1234s"]
    assert lines[3].split()[2:4] == ["2,000,000", "1,621x"]
    # the error loses its unbreakable word whole, not a cut piece of it
    assert lines[4].endswith("num_experts=8  | exit …")
    # every number ends where its column's header ends
    for header in ("tokens/s/dev", "vs base", "MiB", "wall"):
        end = SUMMARY_HEADER.index(header) + len(header)
        assert all(line[end - 1] != " " and line[end] == " " for line in lines[1:4]), header


def test_run_lines_fit_the_width_by_their_least_important_words_first():
    """The error's words go first, then the axes', then the qualifiers'; never part of a word; whole
    without a width (stdout not a terminal)."""
    from moebench.sweep.progress import summary_line

    record = {"point_id": "p002", "status": "failed", "precision": "fp8", "precision_impl": "emulated",
              "point": {"moe.num_experts": 128, "parallel.strategy": "ddp", "moe.top_k": 8},
              "error": "exit code 1: CUDA out of memory while allocating"}
    whole = summary_line(record)
    assert whole.endswith("num_experts=128 strategy=ddp top_k=8  fp8 emulated  "
                          "| exit code 1: CUDA out of memory while allocating")
    for width in range(len(whole), 40, -1):
        line = summary_line(record, width=width)
        assert len(line) <= width or line.split()[2:] == ["…", "…", "|", "…"], (width, line)
        # every word of the line is one of the whole line's words (or the mark of a cut)
        assert set(line.split()) <= set(whole.split()) | {"…"}, line
        kept = line.split("  ")
        if "strategy=ddp" not in line:  # the axes lose words only once the error has none left
            assert kept[-1] == "| …", line
    assert summary_line(record, width=len(whole)) == whole
    assert summary_line(record, width=len(whole) - 1).endswith("top_k=8  fp8 emulated  | exit code 1: CUDA out "
                                                                "of memory while …")
    axis_left = summary_line(record, width=89)
    assert axis_left.endswith(" num_experts=128 …  fp8 emulated  | …") and len(axis_left) == 89
    assert summary_line(record, width=69).endswith("failed" + " " * 39 + "…  fp8 …  | …")  # the qualifiers go last
    assert summary_line(record, width=10).startswith("p002    failed ")  # the columns stay whole


def test_progress_lines_take_the_terminal_width_only_on_a_terminal(monkeypatch):
    import os

    from moebench.sweep import progress

    monkeypatch.setattr(progress.shutil, "get_terminal_size", lambda: os.terminal_size((60, 24)))
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: True)
    assert progress.line_width() == 60
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: False)
    assert progress.line_width() is None


def test_run_lines_give_no_ratio_when_the_baseline_axis_is_not_swept():
    """A suite over num_experts alone with the default strategy baseline: every point is not its own base."""
    from moebench.sweep.progress import Progress

    lines = []
    with Progress(2, enabled=False, echo=lines.append, baseline={"parallel.strategy": "fsdp"}) as bar:
        for i, experts in enumerate([4, 8]):
            bar.finished({"point_id": f"p00{i}", "status": "ok", "tokens_per_s_per_device": 100.0 + i,
                          "point": {"moe.num_experts": experts}, "peak_mem_bytes": 2**20, "point_wall_s": 1.0})
    assert len(lines) == 3 and not any("base" in line.split()[:5] for line in lines[1:])
    assert lines[2].split()[:4] == ["p001", "ok", "101", "1"]


def test_train_and_plan_format_numbers_alike(monkeypatch, capsys):
    """One formatter (moebench.record) for both: 255 K params, not 0.26M; 2,670 tokens/s, not 2670."""
    from moebench.record import format_count
    from moebench.train.run import summary_lines

    record = {"status": "ok", "preset": "tiny", "device_name": "cpu", "precision": "fp32", "precision_impl": "native",
              "moe_backend": "cpu_fused", "world_size": 1, "total_params": 255_000, "active_params": 107_840,
              "flops_per_token": 600_000, "loss_first": 5.5, "loss_last": 5.4, "tokens_per_s": 2670.0,
              "tokens_per_s_per_device": 2670.0, "step_time_median_s": 1.2345, "timed_steps": 3,
              "tflops_per_device": 0.0016, "mfu": 0.014, "peak_flops_source": "calibration",
              "peak_mem_bytes": 435 * 2**20}
    lines = summary_lines(record)
    assert lines[1] == f"params   total {format_count(255_000)}  active 108 K  FLOPs/token 600 K"
    assert format_count(255_000) == "255 K"
    assert lines[3].startswith("speed    2,670 tokens/s (2,670 per device), median step 1,234.5 ms")
    assert lines[4].startswith("compute  1.60 GFLOP/s per device") and lines[5] == "memory   peak 435 MiB"
    code, out, _ = run_cli(["plan", "--preset", "tiny"], monkeypatch, capsys)
    assert code == 0 and re.search(r"^total params +255 K \(255,296\)$", out, re.M), out  # format_count too
