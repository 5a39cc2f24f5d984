"""``host_syncs_per_step``: the Python-level calls that wait on the device, counted in the run's
untimed memory step, with the moebench function that made each (``host_syncs_by_site``)."""

import pytest
import torch

from moebench.metrics.host_syncs import CountHostSyncs
from moebench.presets import load_config
from moebench.testing import HostSyncError, forbid_host_sync, run_distributed
from moebench.train.run import run_training

SHORT = ["train.steps=3", "train.warmup_steps=1", "train.profile_steps=0", "moe.backend=grouped_mm"]
EP2 = ["parallel.dp=2", "parallel.ep=2"]


def test_counts_each_waiting_call_and_names_its_site():
    x = torch.arange(6.0)
    with CountHostSyncs() as syncs:
        x.sum().item()
        x.tolist()
        x[x > 2]  # boolean-mask indexing
        torch.where(x > 2)
        (x * 2).sum()  # no sync
    assert syncs.total == 4
    assert syncs.by_site == {"outside moebench: item": 1, "outside moebench: tolist": 1,
                             "outside moebench: __getitem__": 1, "outside moebench: where": 1}


def test_forbid_and_count_share_one_list():
    """What the CPU sync trap refuses is what the counter counts."""
    x = torch.arange(4)
    for call in (lambda: x.item() if x.numel() == 1 else x[0].item(), lambda: torch.bincount(x), x.nonzero):
        with CountHostSyncs() as syncs:
            call()
        assert syncs.total == 1
        with pytest.raises(HostSyncError), forbid_host_sync():
            call()


def _syncs(overrides: list[str]) -> tuple[int, dict[str, int]]:
    record = run_training(load_config("tiny", SHORT + overrides), log=lambda line: None)
    return record["host_syncs_per_step"], record["host_syncs_by_site"]


def test_one_process_grouped_mm_step_never_waits():
    assert _syncs([]) == (0, {})


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["sync", "rowwise"])
def test_sync_dispatcher_waits_per_moe_layer_rowwise_never(dispatcher):
    """2 gloo ranks, ddp ep=2, one micro-batch per rank, 2 MoE layers: the sync dispatcher reads
    its split sizes on the host in every layer; row-wise dispatch reads nothing."""
    ranks = run_distributed(_syncs, 2, [*EP2, f"parallel.dispatcher={dispatcher}"], timeout=180)
    for total, sites in ranks:
        if dispatcher == "rowwise":
            assert (total, sites) == (0, {})
        else:
            assert sites.get("moebench.parallel.dispatch.dispatch: tolist") == 2, sites
            assert all(site.startswith("moebench.parallel.dispatch.") for site in sites), sites

