"""The run lines of ``moebench run``: each ok run's rate over its baseline point's, zipped layouts included."""

from moebench.sweep.progress import Progress


def _ok(values, tokens):
    return {"status": "ok", "point_id": "p000", "repeat": 0, "point": values, "tokens_per_s_per_device": tokens}


def test_a_zipped_layout_finds_its_baseline_point():
    """smoke's zip moves ep and the dispatcher with the strategy: ddp ep2 rowwise pairs with fsdp ep1 sync at
    the same expert count, not with an fsdp ep2 rowwise point that does not exist."""
    lines: list[str] = []
    fsdp = {"moe.num_experts": 8, "parallel.strategy": "fsdp", "parallel.ep": 1, "parallel.dispatcher": "sync"}
    ddp = {**fsdp, "parallel.strategy": "ddp", "parallel.ep": 2, "parallel.dispatcher": "rowwise"}
    with Progress(4, enabled=False, echo=lines.append, baseline={"parallel.strategy": "fsdp"}) as bar:
        bar.finished(_ok(fsdp, 100.0))
        bar.finished(_ok(ddp, 150.0))
        bar.finished(_ok({**ddp, "moe.num_experts": 16}, 90.0))  # no fsdp point at 16 experts yet
        bar.finished(_ok({**fsdp, "moe.num_experts": 16}, 60.0))
    vs_base = [line.split()[3] if len(line.split()) > 4 and line.split()[3] in ("base", "1.50x") else ""
               for line in lines[1:]]
    assert vs_base == ["base", "1.50x", "", "base"]


def test_the_baseline_is_the_report_pairing_of_the_point():
    """Equal outside the layout and the selector, then the fewest axes apart, and values compared as the
    report compares them: 8 experts and 8.0 are one value; a point at 16 experts has no baseline at 8."""
    from moebench.sweep.progress import baseline_of

    selector = {"parallel.strategy": "fsdp"}
    ddp = {"moe.num_experts": 8, "parallel.strategy": "ddp", "parallel.ep": 2, "parallel.dispatcher": "rowwise"}
    near = {"moe.num_experts": 8.0, "parallel.strategy": "fsdp", "parallel.ep": 2, "parallel.dispatcher": "sync"}
    far = {"moe.num_experts": 8, "parallel.strategy": "fsdp", "parallel.ep": 1, "parallel.dispatcher": "sync"}
    other = {**near, "moe.num_experts": 16}
    assert baseline_of(ddp, [far, other, near], selector) is near  # one layout axis apart, not two
    assert baseline_of(ddp, [other, far], selector) is far
    assert baseline_of({**ddp, "moe.num_experts": 32}, [near, far, other], selector) is None
    assert baseline_of(ddp, [], selector) is None


def test_the_eta_counts_down_between_runs_from_the_measured_time_a_run():
    from moebench.sweep.progress import eta

    assert eta(0, 4, 0.0, 30.0) == "?"  # nothing measured yet
    # 2 of 5 runs took 120 s: 60 s a run, 3 left
    assert [eta(2, 5, 120.0, now) for now in (120.0, 150.0, 179.0)] == ["03:00", "02:30", "02:01"]
    # the running run past its 60 s: the two after it, at least
    assert eta(2, 5, 120.0, 200.0) == "02:00+"
    assert eta(5, 5, 300.0, 400.0) == "00:00"


def test_the_bar_shows_a_moving_eta_between_two_finished_runs():
    """tqdm's own remaining time reads the rate of its last update: frozen while a point runs."""
    import io

    from moebench.sweep.progress import _Bar

    clock = [1000.0]
    out = io.StringIO()
    bar = _Bar(total=4, unit="point", file=out, disable=False, leave=False)
    bar._time = lambda: clock[0]
    bar.start_t = bar.last_print_t = clock[0]
    clock[0] += 40.0
    bar.update(1)  # 40 s a run measured: 3 runs left
    shown = []
    for _ in range(3):
        shown.append(str(bar).split("ETA ")[1].rstrip("]"))
        clock[0] += 10.0
    bar.close()
    assert shown == ["02:00", "01:50", "01:40"]


def test_the_bar_reads_warmup_and_timed_step_lines():
    from moebench.sweep.progress import latest_step

    log = "$ train\nwarmup    7/≤50  loss 5.0  0.100s  80 tokens/s/dev\n"
    assert latest_step(log) == "warmup 7/≤50 80 tokens/s/dev"
    assert latest_step("warmup    2/2  loss 5.0  0.1s\nstep    1/10  loss 4.9  0.1s\n") == "step 1/10"
