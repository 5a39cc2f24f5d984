"""Which layers each pipeline rank's stages hold (parity with the single process:
tests/parallel/test_parallel_parity.py)."""

from __future__ import annotations

import pytest

from moebench.model.transformer import Transformer, build_model
from moebench.parallel.mesh import ParallelDims
from moebench.parallel.pipeline import split_model
from moebench.presets import load_config


def _layers(overrides: list[str], pp_rank: int) -> list[list[str]]:
    cfg = load_config("tiny", ["parallel.pp=2", *overrides])
    dims = ParallelDims(rank=pp_rank, world_size=2, dp=1, ep=1, pp=2, mesh=None, dp_mesh=None, groups={})
    stages = split_model(build_model(cfg), cfg, dims)
    return [list(stage.layers.keys()) for stage in stages]


@pytest.mark.parametrize("overrides,rank0,rank1", [
    # four virtual stages a rank: stages 0, 2, 4, 6 on rank 0, looped
    (["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=4", "model.n_layers=8"],
     [["0"], ["2"], ["4"], ["6"]], [["1"], ["3"], ["5"], ["7"]]),
    # as given, the last stage two layers
    (["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_layers=1,1,1,2", "model.n_layers=5"],
     [["0"], ["2"]], [["1"], ["3", "4"]]),
    (["parallel.pp_layers=1,2", "model.n_layers=3"], [["0"]], [["1", "2"]]),
])
def test_stages_hold_the_layout_layers(overrides, rank0, rank1):
    assert _layers(overrides, 0) == rank0
    assert _layers(overrides, 1) == rank1


def _pp2_step(chunks: int, on_finish) -> None:
    """One step of tiny at PP2 with ``chunks`` chunks a micro-batch, ``on_finish`` after it on each rank."""
    from moebench.train.run import run_training

    cfg = load_config("tiny", ["parallel.pp=2", "train.global_batch_size=8", "train.micro_batch_size=8",
                               f"parallel.pp_microbatches={chunks}", "train.steps=1", "train.warmup_steps=0"])
    run_training(cfg, on_finish=on_finish)


def _last_stage_outputs_alive(chunks: int) -> list[int]:
    """Weak references to every stage output of a step, counted alive after it on each rank."""
    import gc
    import weakref

    alive: list[int] = []

    def on_finish(trainer, dims) -> None:
        outputs: list[weakref.ref] = []
        for module in trainer.strategy.runner.schedule._stage.submod.modules():
            if isinstance(module, Transformer):
                module.register_forward_hook(lambda mod, args, out: outputs.append(weakref.ref(out)))
        trainer.step_once(1)
        gc.collect()
        alive.append(sum(ref() is not None for ref in outputs))

    _pp2_step(chunks, on_finish)
    return alive


@pytest.mark.slow
def test_last_stage_keeps_no_chunk_output_after_the_step():
    """torch's schedule keeps the last stage's outputs (each chunk's logits, the whole micro-batch's)
    until the next step unless told not to return them; nothing reads them (the loss is taken per chunk)."""
    from moebench.testing import run_distributed

    first, last = run_distributed(_last_stage_outputs_alive, 2, 8)
    assert first == [0] and last == [0], (first, last)


def _receive_buffer_bytes(chunks: int) -> list[int]:
    """The bytes a rank's stage keeps in its receive buffers (activations and gradients) after a step."""
    held: list[int] = []

    def on_finish(trainer, dims) -> None:
        stage = trainer.strategy.runner.schedule._stage
        infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
        held.append(sum(i.buffer.nbytes for chunk in infos for i in chunk if i.buffer is not None))

    _pp2_step(chunks, on_finish)
    return held


@pytest.mark.slow
def test_stages_keep_no_receive_buffer_between_steps():
    """torch keeps one receive buffer per chunk for the stage's life, a whole micro-batch of the
    residual stream on each side of a stage boundary (131,072 bytes each at tiny); a chunk's are
    dropped after its backward."""
    from moebench.testing import run_distributed

    assert run_distributed(_receive_buffer_bytes, 2, 8) == [[0], [0]]
