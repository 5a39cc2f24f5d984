"""MLPerf-style ``:::MLLOG {json}`` lines of a run record (``moebench train --mllog``, ``moebench run --mllog``).

The lines are written by the ``mlperf-logging`` package's own logger (:class:`mlperf_logging.mllog.MLLogger`)
with its key constants, so tools that read MLPerf Training logs read these. They are written after
the run, from its record (:mod:`moebench.record`), not live:

- ``submission_*``: the system description MLPerf Training logs carry: org ``moebench``, division
  ``open`` and status ``research`` (a moebench run is no MLPerf submission), platform
  ``<ranks>x<device name>``, benchmark ``moebench_<preset>``;
- ``init_start`` / ``init_stop`` / ``run_start`` at the record's ``started_at``, ``run_stop`` at
  ``started_at + wall_time_s`` with status ``success`` (an ``ok`` record) or ``aborted``: moebench
  does not split set-up from training in wall-clock time, so the run interval is the whole run;
- ``global_batch_size`` (sequences per optimizer step), ``max_sequence_length``, ``seed``, ``opt_name``,
  ``opt_base_learning_rate``, ``expert_parallelism``, ``pipeline_parallelism``, ``micro_batch_size``,
  ``gradient_accumulation_steps``, ``trained_samples`` (sequences trained, warm-up included);
- ``tracked_stats`` with ``{"throughput": tokens/s, ...}`` (the key MLPerf reference implementations log
  their throughput under; the package has no constant for it), at ``run_stop``'s time, ``ok`` runs only.

``moebench_<preset>`` is no MLPerf Training benchmark and moebench logs no evaluation, so the
package's compliance checker cannot pass a moebench log against an MLPerf ruleset; the tests run its
checker with moebench's own rules (:data:`RULES`, ``mllog_rules.yaml`` beside this file: line format,
required keys, their order), as docs/results-store.md says.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ORG = "moebench"
RULES = Path(__file__).with_name("mllog_rules.yaml")  # for the package's compliance checker (--config)
THROUGHPUT_KEY = "tracked_stats"  # what MLPerf reference implementations log throughput under


def _ms(iso: str | None) -> int | None:
    if not iso:
        return None
    try:
        stamp = datetime.fromisoformat(iso)
    except ValueError:
        return None
    stamp = stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)
    return int(stamp.timestamp() * 1000)


def run_interval_ms(record: dict[str, Any]) -> tuple[int, int]:
    """(start, stop) of the run in ms since the epoch: ``started_at`` and its ``wall_time_s``; a record
    that has neither (a point that never printed one) ends at the sweep's ``finished_at`` and starts
    ``point_wall_s`` before it."""
    start = _ms(record.get("started_at"))
    wall = record.get("wall_time_s") if start is not None else record.get("point_wall_s")
    wall_ms = int(1000 * wall) if isinstance(wall, (int, float)) else 0
    if start is not None:
        return start, start + wall_ms
    stop = _ms(record.get("finished_at")) or int(datetime.now(timezone.utc).timestamp() * 1000)
    return stop - wall_ms, stop


def write_mllog(record: dict[str, Any], path: str | Path) -> Path:
    """Write ``record`` as ``:::MLLOG`` lines to ``path`` (replaced if it exists); returns the path."""
    from mlperf_logging.mllog import constants as c
    from mlperf_logging.mllog.mllog import MLLogger

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a logger of its own per file: the package's default one is process-wide and prints to stdout,
    # where `moebench train --json` keeps the record
    logger = logging.Logger(f"moebench.mllog.{path}", level=logging.INFO)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    logger.addHandler(handler)
    try:
        # call sites relative to the checkout (``moebench/metrics/mllog.py``), not this machine's path
        _log(MLLogger(logger, root_dir=str(Path(__file__).parents[2])), c, record)
    finally:
        handler.close()
    return path


def _log(log: Any, c: Any, record: dict[str, Any]) -> None:
    start, stop = run_interval_ms(record)
    cfg = record.get("config") or {}
    train, model, parallel = cfg.get("train") or {}, cfg.get("model") or {}, cfg.get("parallel") or {}

    def event(key: str, value: Any, time_ms: int = start, **metadata: Any) -> None:
        if value is not None:
            log.event(key=key, value=value, time_ms=time_ms, metadata=metadata)

    ranks = record.get("world_size") or record.get("nproc") or 1
    event(c.SUBMISSION_ORG, ORG)
    event(c.SUBMISSION_PLATFORM, f"{ranks}x{record.get('device_name') or record.get('device') or 'unknown'}")
    event(c.SUBMISSION_DIVISION, c.OPEN)
    event(c.SUBMISSION_STATUS, c.RESEARCH)
    event(c.SUBMISSION_BENCHMARK, f"moebench_{record.get('preset') or cfg.get('preset') or 'unknown'}")
    log.start(key=c.INIT_START, time_ms=start)
    event(c.GLOBAL_BATCH_SIZE, train.get("global_batch_size"))
    event(c.MICRO_BATCH_SIZE, train.get("micro_batch_size"))
    if train.get("global_batch_size") and train.get("micro_batch_size") and parallel.get("dp"):
        event(c.GRADIENT_ACCUMULATION_STEPS,
              train["global_batch_size"] // (train["micro_batch_size"] * parallel["dp"]))
    event(c.MAX_SEQUENCE_LENGTH, model.get("seq_len"))
    event(c.SEED, train.get("seed"))
    event(c.OPT_NAME, c.ADAMW if train else None)
    event(c.OPT_BASE_LR, train.get("lr"))
    event(c.EXPERT_PARALLELISM, parallel.get("ep"))
    event(c.PIPELINE_PARALLELISM, parallel.get("pp"))
    log.end(key=c.INIT_STOP, time_ms=start)
    log.start(key=c.RUN_START, time_ms=start)
    ok = record.get("status") == "ok"
    steps = (record.get("warmup_steps_used") or 0) + (record.get("timed_steps") or 0)
    if ok and steps and train.get("global_batch_size"):
        event(c.TRAINED_SAMPLES, train["global_batch_size"] * steps, stop)
    if ok and record.get("tokens_per_s") is not None:
        event(THROUGHPUT_KEY, {"throughput": record["tokens_per_s"],
                               "tokens_per_s_per_device": record.get("tokens_per_s_per_device"),
                               "step_time_median_s": record.get("step_time_median_s")},
              stop, step=steps, unit="tokens/s")
    log.end(key=c.RUN_STOP, time_ms=stop,
            metadata={c.STATUS: c.SUCCESS if ok else c.ABORTED, "moebench_status": record.get("status")})
