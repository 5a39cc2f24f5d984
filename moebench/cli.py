"""Command line: ``moebench train | plan | bench | env | gpu-check`` here; ``run``, ``status``, ``report``,
``check`` and ``claim`` are defined in ``sweep/``, ``report/`` and ``claim/`` and registered at the end.

A command imports its implementation when it runs, so that ``moebench`` starts with only what every
command needs: train and bench load torch (seconds), report and check pandas and matplotlib, plan its
planner (tens of ms); each such import says which.

User errors (:class:`moebench.errors.MoebenchError`) print one line and exit 2, never a
traceback.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import click

from moebench.claim.cli import claim_cmd
from moebench.config import Config
from moebench.devices import DEVICES
from moebench.errors import ConfigError, MoebenchError
from moebench.layout import MAX_RANKS, layout_problems
from moebench.plan.roofline import MATMUL_EFFICIENCY_SOURCE, MIN_MATMUL_EFFICIENCY
from moebench.presets import PRESETS, load_config
from moebench.record import to_json_line
from moebench.report.cli import check_cmd, report_cmd
from moebench.sweep.cli import run_cmd, status_cmd

preset_option = click.option(
    "--preset", default="tiny", show_default=True, help=f"Model preset: {', '.join(PRESETS)}."
)
set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a config field, e.g. --set moe.num_experts=32 (repeatable).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")


class OneLineUsageError(click.UsageError):
    """A usage error said in one line, with where to read the usage (click's own takes three)."""

    def __init__(self, error: click.UsageError) -> None:
        super().__init__(error.format_message(), error.ctx)

    def show(self, file: object = None) -> None:
        hint = f"; see '{self.ctx.command_path} --help'" if self.ctx is not None else ""
        click.echo(f"error: {self.format_message().rstrip('.')}{hint}", err=True)


class MoebenchGroup(click.Group):
    """The top-level group: usage errors of any command under it become :class:`OneLineUsageError`
    (exit 2 still)."""

    def make_context(self, *args: object, **kwargs: object) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            raise exc if isinstance(exc, OneLineUsageError) else OneLineUsageError(exc) from None

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise exc if isinstance(exc, OneLineUsageError) else OneLineUsageError(exc) from None


@click.group(cls=MoebenchGroup, invoke_without_command=True, subcommand_metavar="COMMAND [ARGS]...",
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moebench")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """moebench: measure how mixture-of-experts language models train."""
    if ctx.invoked_subcommand is None:  # bare `moebench` asks what there is: the help, exit 0
        click.echo(ctx.get_help())


@cli.command()
@preset_option
@set_option
@click.option("--steps", type=click.IntRange(max=10**7), default=None, help="Shorthand for --set train.steps=N.")
@click.option("--nproc", type=click.IntRange(max=MAX_RANKS), default=1, show_default=True,
              help="Ranks to launch (torchrun standalone; across the nodes of an salloc/sbatch allocation); "
                   "must equal parallel.dp x parallel.pp.")
@click.option("--oversubscribe", is_flag=True, help="Start --nproc ranks even when this machine has fewer GPUs "
              "(or, on CPU, fewer CPUs) than ranks.")
@json_option
@click.option("--mllog", "mllog_path", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="Also write the run as MLPerf-style ':::MLLOG' lines to PATH (run start/stop, throughput, "
                   "global batch size, system description).")
def train(preset: str, overrides: tuple[str, ...], steps: int | None, nproc: int, oversubscribe: bool,
          as_json: bool, mllog_path: str | None) -> None:
    """Train a model and report throughput, MFU, memory and losses."""
    if mllog_path is not None:  # the log is written after training: a folder it cannot go to fails now
        _check_writable_file("--mllog", mllog_path, makes_folders=True)
    # train/ imports torch; launch/ and the MLLOG writer serve this command alone
    from moebench.launch.ending import leave
    from moebench.launch.leader import check_local_ranks, launch_local
    from moebench.launch.multinode import allocation_nodes, launch_across
    from moebench.metrics.instructions import run_under_callgrind, under_callgrind
    from moebench.metrics.mllog import write_mllog
    from moebench.train.distributed import adopt_launch_env
    from moebench.train.run import run_training, summary_lines

    items = list(overrides) + ([f"train.steps={steps}"] if steps is not None else [])
    if steps is not None and not any(i.partition("=")[0].strip() == "train.warmup_steps" for i in overrides) \
            and preset in PRESETS and PRESETS[preset]().train.warmup_steps >= steps:
        items.append(f"train.warmup_steps={steps - 1}")  # --steps 1 times its one step
    if nproc < 1:
        raise click.BadParameter(f"--nproc must be >= 1, got {nproc}")
    if adopt_launch_env():
        cfg = load_config(preset, items)
    else:
        # one rank too: ep=2 on a single process would otherwise train unsharded under an EP label;
        # a dp x pp above one rank is left to run_training, which says which --nproc to launch with
        cfg = _checked_config(preset, items, nproc if nproc > 1 else None)
        nodes = allocation_nodes()  # under salloc/sbatch of several nodes, the ranks spread over them
        if nproc > 1 and nodes == 1 and not oversubscribe:  # this machine's devices, not another node's
            check_local_ranks(nproc, cfg.train.device)
        if nproc > 1:
            argv = _train_argv(preset, items, as_json, mllog_path)
            leave(launch_across(nodes, nproc, argv) if nodes > 1 else launch_local(nproc, argv))
        if cfg.train.instructions and not under_callgrind():  # this process again, counted by callgrind
            sys.exit(run_under_callgrind(_train_argv(preset, items, as_json, mllog_path)))
    record = run_training(cfg, log=None if as_json else click.echo)
    code = 0 if record["status"] == "ok" else 1
    if int(os.environ.get("RANK", "0")) == 0:  # only rank 0 reports
        if as_json:
            click.echo(to_json_line(record))
        else:
            for line in summary_lines(record):
                click.echo(line)
        if mllog_path:  # after the record: a log that cannot be written does not lose the run
            try:
                write_mllog(record, mllog_path)
            except OSError as exc:
                raise ConfigError(f"--mllog {mllog_path}: cannot write it: {exc.strerror or exc}") from None
    if adopt_launch_env():  # the process group is torn down and the record written
        leave(code)
    if code:
        sys.exit(code)


def _train_argv(preset: str, items: list[str], as_json: bool, mllog_path: str | None) -> list[str]:
    """``train ...`` as the processes this one starts (the ranks, or itself under valgrind) run it."""
    argv = ["train", "--preset", preset, *[a for item in items for a in ("--set", item)]]
    argv += ["--json"] if as_json else []
    # absolute: the ranks' working directory is not promised to be this one
    return argv + (["--mllog", os.path.abspath(mllog_path)] if mllog_path else [])


def _check_writable_file(option: str, path: str, makes_folders: bool = False) -> None:
    """Refuse, before any work, a file that could not be written: an empty path, a folder, a missing
    folder (unless the writer ``makes_folders``: then the nearest one that exists), or no permission."""
    if not path.strip():
        raise ConfigError(f"{option} '': an empty path names no file")
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise ConfigError(f"{option} {path}: is a folder; name a file")
    folder = os.path.dirname(target)
    while makes_folders and not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"{option} {path}: folder {folder} does not exist")
    blocked = target if os.path.exists(target) else folder
    if not os.access(blocked, os.W_OK) or not os.access(folder, os.X_OK):
        raise ConfigError(f"{option} {path}: {blocked} is not writable")


def _checked_config(preset: str, items: list[str], world_size: int | None) -> Config:
    """The preset with ``items`` set, its config and layout problems in one error, so that fixing one
    does not uncover the next."""
    cfg = load_config(preset, items, validate=False)  # an unknown preset, key or value: its own error
    problems = []
    try:
        cfg.validate()
    except ConfigError as exc:
        problems.append(str(exc))
    try:
        cfg.validate_sizes()  # the layout rules divide by the sizes
    except ConfigError:
        pass
    else:
        layout = [pr.message for pr in layout_problems(cfg, world_size)]
        if layout:
            problems.append("impossible parallel layout: " + "; ".join(layout))
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


@cli.command(short_help="Plan a layout: parameters, FLOPs, memory, comms, tokens/s.")
@preset_option
@set_option
@click.option("--gpus", type=click.IntRange(max=MAX_RANKS), default=None, help="Plan for N GPUs: dp = N / parallel.pp.")
@click.option("--gpu", type=click.Choice(list(DEVICES), case_sensitive=False), default=None,
              help="Device to plan for (default h200 once --gpus or --search is given).")
@click.option("--search", "do_search", is_flag=True, help="Rank every valid layout for --gpus by planned tokens/s.")
@click.option("--top", type=int, default=10, show_default=True, help="Layouts shown by --search.")
@click.option("--matmul-efficiency", type=float, default=None,
              help=f"Share of the peak FLOP/s that matmuls reach (default {MATMUL_EFFICIENCY_SOURCE}).")
@click.option("--matmul-efficiency-from", "measured_from", default=None, metavar="GPU_CHECK_JSON",
              help="Take the matmul efficiency from the dense rate scripts/gpu_check.sh measured "
                   "(its gpu_check.json) and plan on the GPU it ran on.")
@click.option("--overlap", type=click.Choice(["default", "none"]), default="default", show_default=True,
              help="default: gradient reduction and FSDP gathers hidden behind compute; none: all exposed.")
@click.option("--mem-reserve", type=float, default=None, help="Share of HBM kept free (default 0.10).")
@click.option("--profile", "profile_path", default=None, metavar="FILE",
              help="Predict with a machine profile (from --calibrate) instead of the roofline; plans on its machine.")
@click.option("--calibrate", "calibrate_stores", multiple=True, metavar="STORE",
              help="Fit a machine profile to the time breakdowns measured in STORE (repeatable); no plan is made.")
@click.option("--validate", "do_validate", is_flag=True,
              help="Plan every published operating point (moebench/published/*.yaml) that has a preset at its "
                   "published layout, beside the published value, with the matmul efficiency fitted on the "
                   "rows declared calibration.")
@click.option("--unfitted", is_flag=True,
              help="With --validate: plan at the default (or --matmul-efficiency) matmul efficiency, "
                   "not the fitted one.")
@click.option("--verify", "do_verify", is_flag=True,
              help="Dry-run the real trainer at this layout (fake tensors, a fake process group, one step per "
                   "rank position) and print plan vs dry run: memory by part, FLOPs, bytes per axis.")
@click.option("-o", "--output", default=None, metavar="FILE", help="With --calibrate: write the profile to FILE.")
@click.option("--holdout", type=click.Choice(["half", "ranks"]), default=None,
              help="With --calibrate: also fit on part of the points and report the error on the rest "
                   "(half: every other point of each layout; ranks: fit the fewest ranks, predict the others).")
@json_option
def plan(preset: str, overrides: tuple[str, ...], gpus: int | None, gpu: str | None, do_search: bool, top: int,
         matmul_efficiency: float | None, measured_from: str | None, overlap: str, mem_reserve: float | None,
         profile_path: str | None,
         calibrate_stores: tuple[str, ...], do_validate: bool, unfitted: bool, do_verify: bool, output: str | None,
         holdout: str | None, as_json: bool) -> None:
    """Parameter counts and FLOPs per token; with --gpus/--gpu/--search, a memory, communication
    and throughput plan of the layout (no model is built); with --calibrate, a machine profile
    fitted to measured runs, which --profile then plans with."""
    # the planner (torch-free), for this command alone
    from moebench.kernels.torch_build import installed_kernel_gap
    from moebench.plan.command import read_profile, run_plan
    from moebench.plan.measured_rate import read_gpu_check
    from moebench.plan.planner import PlanOptions

    if calibrate_stores:
        _calibrate(list(calibrate_stores), output, holdout, as_json)
        return
    for name, value in (("-o/--output", output), ("--holdout", holdout)):
        if value is not None:
            raise ConfigError(f"{name} goes with --calibrate STORE")
    if unfitted and not do_validate:
        raise ConfigError("--unfitted goes with --validate")

    for name, value, ok, rule in [
        # below 1% of the peak a plan's rates round to 0 tokens/s: no GPU's matmuls run that slowly
        ("--matmul-efficiency", matmul_efficiency,
         matmul_efficiency is None or MIN_MATMUL_EFFICIENCY <= matmul_efficiency <= 1,
         f"a share of the peak in [{MIN_MATMUL_EFFICIENCY}, 1]"),
        ("--mem-reserve", mem_reserve, mem_reserve is None or 0 <= mem_reserve < 1, "a share of HBM in [0, 1)"),
        ("--top", top, top >= 1, ">= 1"),
    ]:
        if not ok:  # NaN fails every comparison, so it lands here too
            raise ConfigError(f"{name} {value}: must be {rule}")
    defaults = PlanOptions()
    efficiency, source = defaults.matmul_efficiency, defaults.matmul_efficiency_source
    if matmul_efficiency is not None:
        efficiency, source = matmul_efficiency, "given by --matmul-efficiency"
    if measured_from is not None:
        if matmul_efficiency is not None or profile_path is not None:
            raise ConfigError("--matmul-efficiency-from replaces --matmul-efficiency and --profile: give one")
        measured = read_gpu_check(measured_from)
        if gpu is not None and gpu != measured.gpu:
            raise ConfigError(f"--gpu {gpu} differs from the GPU {measured_from} was measured on "
                              f"({measured.gpu}); drop --gpu or measure on a {gpu}")
        gpu, efficiency, source = measured.gpu, measured.efficiency, measured.source
    options = PlanOptions(
        matmul_efficiency=efficiency,
        matmul_efficiency_source=source,
        overlap=overlap,
        mem_reserve=defaults.mem_reserve if mem_reserve is None else mem_reserve,
        profile=read_profile(profile_path) if profile_path else None,
        kernel_gap=installed_kernel_gap,
    )
    if do_validate:
        if overrides or gpus is not None or gpu is not None or do_search or profile_path or measured_from:
            raise ConfigError("--validate plans each published row at its own layout and GPU: it takes no --set, "
                              "--gpus, --gpu, --search, --profile or --matmul-efficiency-from")
        if matmul_efficiency is not None and not unfitted:
            raise ConfigError("--validate fits the matmul efficiency on the calibration rows: add --unfitted to plan "
                              "at --matmul-efficiency instead")
        from moebench.plan.command import run_validate

        run_validate(options, not unfitted, as_json)
        return
    if do_verify:
        if do_search or profile_path or measured_from:
            raise ConfigError("--verify dry-runs one layout: it takes no --search, --profile or "
                              "--matmul-efficiency-from")
        from moebench.plan.command import run_verify

        run_verify(preset, list(overrides), gpus, gpu, as_json)
        return
    run_plan(preset, list(overrides), gpus, gpu, do_search, top, as_json, options)


def _calibrate(paths: list[str], output: str | None, holdout: str | None, as_json: bool) -> None:
    """Read every store's latest records, then fit."""
    # the planner's fit, for plan --calibrate alone
    from moebench.plan.calibrate import store_points
    from moebench.plan.command import run_calibrate

    stores, points = store_points(paths, lambda warning: click.echo(f"warning: {warning}", err=True))
    run_calibrate(points, stores, output, holdout, as_json)


def positive(name: str, default: int, **kwargs):
    """A bench command's size or count: an integer option of at least 1."""
    return click.option(name, type=click.IntRange(min=1), default=default, show_default=True, **kwargs)


@cli.group(short_help="Microbenchmarks: ratios measured side by side.")
def bench() -> None:
    """Microbenchmarks that report ratios measured side by side in one process."""


@bench.command("moe-layer", short_help="MoE layer fwd+bwd vs a dense matmul of the same FLOPs.")
@positive("--tokens", 4096)
@positive("--d-model", 512)
@positive("--hidden", 512)
@positive("--experts", 64)
@positive("--top-k", 8)
@positive("--repeats", 7)
@click.option("--no-loop", is_flag=True, help="Skip the (slow) loop backend.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="The compute dtype. bf16: the MoE rows run as precision.mode=bf16 trains (fp32 master "
              "weights under autocast), plus one labelled row with the whole block in bf16.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the full result JSON here.")
@json_option
def bench_moe_layer(tokens: int, d_model: int, hidden: int, experts: int, top_k: int, repeats: int,
                    no_loop: bool, dtype: str, out: str | None, as_json: bool) -> None:
    """MoE layer forward+backward vs a dense matmul of the same FLOPs, on CPU."""
    # sizes and paths before torch is imported (seconds)
    if top_k > experts:
        raise ConfigError(f"--top-k {top_k} exceeds --experts {experts}")
    _check_layer_size(tokens, d_model, hidden, experts, top_k, 2 if dtype == "bf16" else 4)
    if out is not None:  # checked before the benchmark runs, so its result has somewhere to go
        _check_writable_file("--out", out)
    # torch
    from moebench.bench.moe_layer import DTYPES, LayerShape, format_table, run_benchmark
    from moebench.metrics.memory import allocation_failure

    shape = LayerShape(tokens, d_model, hidden, experts, top_k)
    try:
        result = run_benchmark(shape, repeats=repeats, dtype=DTYPES[dtype], include_loop=not no_loop)
    except (MemoryError, RuntimeError) as exc:
        why = allocation_failure(exc)
        if why is None:
            raise
        raise ConfigError(f"the layer T={tokens} D={d_model} H={hidden} E={experts} K={top_k} does not fit in "
                          f"memory here: {why}") from None
    if out:
        try:
            with open(out, "w") as fh:
                json.dump(result, fh, indent=1)
        except OSError as exc:  # the result is still printed below
            click.echo(f"warning: --out {out}: cannot write the result ({exc.strerror})", err=True)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"MoE layer fwd+bwd, T={tokens} D={d_model} H={hidden} E={experts} K={top_k}, "
               f"{result['dtype']}, {result['threads']} threads, {repeats} interleaved rounds")
    click.echo(f"precision: {result['precision_path']}")
    for line in format_table(result):
        click.echo(line)


def _check_layer_size(tokens: int, d_model: int, hidden: int, experts: int, top_k: int, item_bytes: int) -> None:
    """Refuse a layer whose routed rows' activations alone (T*K rows of 3H + 2D values) or expert
    weights (E*3*D*H) exceed this machine's memory, before torch is imported; beyond 2^63 elements
    torch would not even take the sizes (a TypeError)."""
    rows = tokens * top_k
    need = item_bytes * max(rows * (3 * hidden + 2 * d_model), experts * 3 * d_model * hidden)
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        have = 2**63
    if need > have:
        raise ConfigError(f"the layer T={tokens} D={d_model} H={hidden} E={experts} K={top_k} needs at least "
                          f"{need / 2**30:,.1f} GiB for its routed rows or its experts' weights, more than this "
                          f"machine's {have / 2**30:,.1f} GiB; choose smaller sizes")


@bench.command("e2e", short_help="Training end to end: moebench vs a transformers OlmoeForCausalLM loop.")
@positive("--vocab", 4096)
@positive("--d-model", 512)
@positive("--layers", 4)
@positive("--heads", 8)
@positive("--experts", 32)
@positive("--top-k", 4)
@positive("--hidden", 256, help="Expert hidden size.")
@positive("--seq-len", 256)
@positive("--micro-batch", 4)
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed steps per process.")
@positive("--steps", 10, help="Timed steps per process.")
@positive("--rounds", 3, help="Fresh processes per side and precision.")
@click.option("--precision", "precisions", type=click.Choice(["fp32", "bf16"]), multiple=True,
              help="Repeatable; default both.")
@click.option("--hf-experts", type=click.Choice(["grouped_mm", "eager"]), default="grouped_mm",
              show_default=True, help="transformers' experts_implementation (not batched_mm: it gathers a weight "
              "matrix per routed token, gigabytes at this shape).")
@click.option("--compiled", is_flag=True, help="Also time moebench with train.compile=true (compiled / eager).")
@click.option("--breakdown", is_flag=True, help="Time moebench's phases inside its timed steps "
              "(train.phase_clock=true; off otherwise) and print where its step goes, phase by phase.")
@json_option
def bench_e2e(vocab: int, d_model: int, layers: int, heads: int, experts: int, top_k: int, hidden: int,
              seq_len: int, micro_batch: int, warmup: int, steps: int, rounds: int, precisions: tuple[str, ...],
              hf_experts: str, compiled: bool, breakdown: bool, as_json: bool) -> None:
    """Train moebench and the loop a user would write with transformers' OlmoeForCausalLM (same shape,
    AdamW), in fresh processes interleaved round by round; tokens/s per round and each ratio with its
    interval: moebench / transformers (moebench alone when transformers is not installed), compiled /
    eager with --compiled, and moebench's bf16 / fp32 when both precisions run."""
    from moebench.bench import e2e
    from moebench.results.stats import rate_ratio

    shape = e2e.E2EShape(vocab, d_model, layers, heads, experts, top_k, hidden, seq_len, micro_batch)
    timing = e2e.Timing(warmup=warmup, steps=steps, rounds=rounds, hf_experts=hf_experts,
                        phase_clock=breakdown)
    log = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    if e2e.transformers_version() is None:
        log("transformers is not installed (pip install 'moebench[e2e]'): timing moebench alone, no ratio")
    result = e2e.run_e2e(shape, timing, precisions or e2e.PRECISIONS, progress=log, compiled=compiled)
    result["comparisons"] = []
    for comparison in e2e.comparisons(result):
        # the same tokens a step on both sides: the ratio is one of median step times
        ratio = rate_ratio(comparison.numerator, comparison.denominator)
        result["comparisons"].append({"label": comparison.label, "precision": comparison.precision} | (
            {"value": None} if ratio is None else {
                "value": ratio.value, "low": ratio.low, "high": ratio.high, "confidence": ratio.confidence,
                "runs": list(ratio.runs), "verdict": ratio.verdict, "text": ratio.text()}))
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"end to end, V={vocab} D={d_model} L={layers} heads={heads} E={experts} K={top_k} H={hidden}, "
               f"{micro_batch}x{seq_len} tokens a step, {warmup} warm-up + {steps} timed steps a process, "
               f"{rounds} interleaved rounds")
    for line in e2e.kernel_lines(result):
        click.echo(line)
    for precision in result["rounds"]:
        click.echo(f"{precision}:")
        for line in e2e.format_rounds(result, precision):
            click.echo(line)
    for comparison in result["comparisons"]:
        text = comparison.get("text", "no finished run on one side")
        click.echo(f"{comparison['label']} tokens/s, {comparison['precision']}: {text}")
    for line in e2e.breakdown_lines(result):
        click.echo(line)


@cli.command("env", short_help="What this machine can run: versions, devices, NVML, Slurm.")
@json_option
def env_cmd(as_json: bool) -> None:
    """What this machine can run: versions, devices and how each precision runs there, NVML, Slurm."""
    # torch, to list the devices
    from moebench.metrics.environment import environment, environment_lines

    env = environment()
    if as_json:
        click.echo(json.dumps(env))
    else:
        for line in environment_lines(env):
            click.echo(line)


@cli.command("gpu-check", short_help="GPU acceptance check (scripts/gpu_check.sh).", add_help_option=False,
             context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def gpu_check_cmd(args: tuple[str, ...]) -> None:
    """GPU check: CUDA tests, grouped GEMM and MoE layer rates vs dense, fp8/mxfp8, sync-free routing, NVML.

    Same as scripts/gpu_check.sh: ``moebench gpu-check OUT_DIR [--repeats N] [--skip ...]``.
    """
    # torch and triton
    from moebench.bench.gpu_check import main as gpu_check_main

    sys.exit(gpu_check_main(list(args)))  # 1 when a section failed


# the commands defined beside their implementations
cli.add_command(run_cmd, "run")
cli.add_command(status_cmd, "status")
cli.add_command(report_cmd, "report")
cli.add_command(check_cmd, "check")
cli.add_command(claim_cmd, "claim")


def main() -> None:
    try:
        cli.main(prog_name="moebench", standalone_mode=False)  # also under python -m moebench.cli
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MoebenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        name = str(exc.filename or "")
        click.echo(f"error: {name[:80]}{'...' if len(name) > 80 else ''}: path too long ({exc.strerror}; "
                   "a name may have at most 255 bytes, a path 4096)", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
