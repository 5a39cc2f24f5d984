"""A point's line in ``records.jsonl`` as a typed value: the run record the trainer printed (or, for a
point that printed none, what its config alone tells) and the fields the sweep adds to it, which
docs/results-store.md ("records.jsonl") lists. :meth:`StoreRecord.to_dict` is the object the store
writes (:func:`moebench.record.to_json_line`); :func:`moebench.sweep.launch.point_record` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moebench.record import fields_of


@dataclass(frozen=True)
class Share:
    """The time limit a local run ran under and the machine's load meanwhile
    (:class:`moebench.launch.share.ShareClock`): whether a slow or timed-out run had a busy machine."""

    time_limit_s: float | None  # fair-share seconds (wall seconds for a Slurm task)
    point_share_s: float  # fair-share seconds the run took, to 3 decimals
    cores: int
    load_start: float | None
    load_mean: float | None


@dataclass(frozen=True)
class StoreRecord:
    """One run of a point as the store keeps it. The run record's own fields come first, in its order;
    ``from_config`` fills those it lacks; the point's fields below replace any of the same name."""

    run: dict[str, Any]  # the run record, or {schema_version, preset} when the point printed none
    # config, config_hash, world_size, layout and the cost model's counts (empty without a config)
    from_config: dict[str, Any]
    point_id: str
    key: str
    repeat: int
    repeats: int
    point: dict[str, Any]  # the point's axis values
    nproc: int | None
    status: str
    error: str | None
    finished_at: str  # ISO time
    point_wall_s: float | None  # the whole point, process start included
    hostname: str  # Slurm tasks of one sweep can land on different nodes
    share: Share | None  # None: the run's process did not run under a fair-share clock
    log_tail: str | None  # the log's last characters; None when ok
    rank_tails: dict[str, str] | None  # {rank: stderr tail} of a multi-rank run not ok; None otherwise

    def to_dict(self) -> dict[str, Any]:
        record = dict(self.run)
        for name, value in self.from_config.items():
            record.setdefault(name, value)
        own = fields_of(self)
        for part in ("run", "from_config", "share", "log_tail", "rank_tails"):
            del own[part]
        record.update(own)
        if self.share is not None:
            record.update(fields_of(self.share))
        record["log_tail"] = self.log_tail
        record["rank_tails"] = self.rank_tails
        return record
