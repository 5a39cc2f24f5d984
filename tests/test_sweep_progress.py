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
