"""Every cluster file under experiments/conf/cluster/ composes into a configuration the schema accepts, with
every planner: a hardware key that a later feature made required (e.g. ``host_to_device_bytes_per_s`` for
the reload path and ForeMoE's host transfers) cannot go missing from one file unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.config.checks import check_config
from tests.builders import CONF, cfg

CLUSTERS = sorted(p.stem for p in (Path(CONF) / "cluster").glob("*.yaml"))


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_cluster_file_validates(cluster: str) -> None:
    check_config(cfg(f"cluster={cluster}"))


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_cluster_file_prices_the_host_path(cluster: str) -> None:
    config = cfg(f"cluster={cluster}", "planner=foremoe", "simulator.migration.path=reload")
    check_config(config)
    assert float(config.cluster.hardware.host_to_device_bytes_per_s) > 0
