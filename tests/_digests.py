"""The check most kernel tests end with: every replica holds the same namespace."""

from __future__ import annotations

from nbos.cluster import Kernel


async def assert_replicas_agree(kernel: Kernel, replicas: int = 3, timeout: float = 30.0) -> None:
    """``replicas`` live replicas answer with their digest, and the digests are equal."""
    digests = await kernel.digests(timeout=timeout)
    assert len(digests) == replicas and len(set(digests.values())) == 1, digests
