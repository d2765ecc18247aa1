"""Fixtures for the Raft tests: small, deterministic in-memory clusters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from nbos.raft.core import RaftConfig
from nbos.raft.core.sim import SimCluster

MakeCluster = Callable[..., SimCluster]


@pytest.fixture
def config() -> RaftConfig:
    return RaftConfig(
        election_ticks=10,
        heartbeat_ticks=1,
        max_inflight=8,
        max_batch_bytes=4096,
        snapshot_chunk_bytes=64,
    )


@pytest.fixture
def make_cluster(config: RaftConfig) -> MakeCluster:
    """``make_cluster(n, seed=0, **config_overrides)``: a bootstrapped group of nodes 1..n."""

    def make(n: int = 3, seed: int = 0, **overrides: Any) -> SimCluster:
        cfg = dataclasses.replace(config, **overrides)
        return SimCluster.bootstrapped(list(range(1, n + 1)), cfg, seed)

    return make
