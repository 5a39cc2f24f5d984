"""Test helpers shipped with the package (used by moebench's tests and usable by others)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from moebench.metrics.host_syncs import sync_reason
from moebench.parallel.expert import is_expert_param
from moebench.parallel.mesh import ParallelDims


class HostSyncError(RuntimeError):
    pass


class _ForbidHostSync(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(reason)
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Raise :class:`HostSyncError` on any Python-level call that would sync with the device.

    On CPU nothing ever waits, so this is how CPU tests prove a code path is sync-free; on
    CUDA, combine it with ``torch.cuda.set_sync_debug_mode("error")``, which also catches
    syncs inside C++ ops.
    """
    with _ForbidHostSync():
        yield


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server that every rank of run_distributed forks from, so a rank
# starts with torch and the trainer loaded instead of importing them (seconds of CPU each).
_RANK_PRELOAD = ["torch", "torch.distributed", "moebench.train.run", "moebench.testing"]


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, queue, env: dict[str, str]) -> None:
    import os
    import traceback

    # a forked rank inherits the fork server's environment: give it the test's, as a spawned one gets
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "MOEBENCH_DIST_TIMEOUT_S": "120"})
    torch.set_num_threads(1)
    try:
        queue.put((rank, True, fn(*args)))
    except BaseException:  # report every failure, including SystemExit, to the parent
        queue.put((rank, False, f"[rank {rank}] " + traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` fresh processes wired for ``torch.distributed``
    (gloo on a free loopback port); return each rank's result, rank order. The processes fork
    from a server that has torch and the trainer imported (multiprocessing's forkserver), with
    this process's environment.

    A failing rank's traceback is raised here, prefixed with its rank; ranks still alive
    after a failure or after ``timeout`` seconds are killed, so a test never hangs.
    """
    import multiprocessing as mp
    import os
    import queue as queue_mod
    import time

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)  # read when the server starts: the first call of a session
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f}s (ranks done: {sorted(out)})")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in out]
                if dead:
                    codes = [procs[r].exitcode for r in dead]
                    raise RuntimeError(f"rank(s) {dead} died (exit codes {codes})") from None
                continue
            if not ok:
                raise RuntimeError(value)
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


# Full (unsharded) parameters of a parallelised model, for the parity tests.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_state_dict(model: nn.Module, dims: ParallelDims | None) -> dict[str, Tensor]:
    """Every parameter at full size on every rank (collective: call on all ranks)."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if dims is not None and dims.ep > 1 and is_expert_param(name):
            parts = [torch.empty_like(t) for _ in range(dims.ep)]
            dist.all_gather(parts, t.contiguous(), group=dims.groups["ep"])
            t = torch.cat(parts)
        if dims is not None and dims.pp > 1:
            name = name.split(".", 1)[1]  # drop the PipelineStages index
        out[_clean(name)] = t.detach().cpu().clone()
    if dims is not None and dims.pp > 1:
        stages: list[dict[str, Tensor] | None] = [None] * dims.pp
        dist.all_gather_object(stages, out, group=dims.groups["pp"])
        out = {k: v for stage in stages for k, v in (stage or {}).items()}
    return out
