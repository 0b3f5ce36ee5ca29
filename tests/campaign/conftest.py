"""The campaign tests' shared reference: tests/run.sh runs tests/campaign in one pytest process (beside the xdist
workers), so a session fixture starts once for every module that compares against it."""

from __future__ import annotations

import pytest

from tests.campaign.common import NODE_CHANGE_ARGS, NODE_CHANGE_ENV, NODE_CHANGE_ITERS, Place, non_loopback_ip


@pytest.fixture(scope="session")
def straight_two_nodes(tmp_path_factory) -> dict:
    """One uninterrupted job on 2 fake nodes (one rank each, fp32, no dropout, NODE_CHANGE_ITERS iterations): the
    losses a campaign that changes its node count must end on. Its trainer result (``losses``: iteration -> loss)."""
    master = non_loopback_ip()
    if master is None:
        pytest.skip("no non-loopback IPv4 address here: a job of two fake nodes cannot rendezvous")
    root = tmp_path_factory.mktemp("straight")
    straight = Place(root, NODE_CHANGE_ITERS, RUN_DIR=str(root / "run"), MASTER_ADDR=master, **NODE_CHANGE_ENV)
    job = straight.sbatch("-q", "debug", "-N", "2", "-t", "20:00", args=NODE_CHANGE_ARGS)
    straight.run(max_jobs=1)
    result = straight.result(job)
    assert result is not None and sorted(result["losses"]) == list(range(1, NODE_CHANGE_ITERS + 1)), job
    assert len(set(result["losses"].values())) == NODE_CHANGE_ITERS  # the loss moves: comparisons are not trivial
    return result
