"""GPU binding in the replica: the tensor walk on any machine, real moves where CUDA exists."""

from __future__ import annotations

import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from nbos.gpu import binding  # noqa: E402
from nbos.gpu.binding import TorchGpuBinder  # noqa: E402

pytestmark = pytest.mark.anyio

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def trained_namespace() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    weights = model[0].weight
    return {"model": model, "opt": optimizer, "x": x, "alias": weights, "nested": {"t": [x]}}


def train_step(ns: dict[str, Any], dev: Any) -> float:
    ns["opt"].zero_grad()
    loss = ns["model"](ns["x"].to(dev)).pow(2).mean()
    loss.backward()
    ns["opt"].step()
    return float(loss)


async def test_bind_records_devices_for_user_code() -> None:
    ns = trained_namespace()
    binder = TorchGpuBinder(lambda: ns, target=lambda _: torch.device("cpu"))
    await binder.bind([2, 3])
    assert binder.bound == binding.devices() == (2, 3)
    await binder.release(evict=False)
    assert binding.devices() == ()
    assert binding.device() == torch.device("cpu")


async def test_walk_finds_module_optimizer_and_nested_tensors_once() -> None:
    ns = trained_namespace()
    tensors = list(binding._tensors(binding._torch_objects(ns)))
    ids = [id(t) for t in tensors]
    assert len(ids) == len(set(ids))
    assert id(ns["alias"]) in ids and id(ns["x"]) in ids
    params = sum(1 for _ in ns["model"].parameters())
    adam_moments = 2 * params
    assert len(tensors) >= params + adam_moments + 1


async def test_lazy_release_keeps_residency_until_evict() -> None:
    ns = trained_namespace()
    binder = TorchGpuBinder(lambda: ns, target=lambda _: torch.device("cpu"))
    await binder.bind([0])
    await binder.release(evict=False)
    assert binder.resident == (0,)
    await binder.evict()
    assert binder.resident == ()


async def test_a_cell_that_imports_torch_leaves_its_devices_resident(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Bound before torch was loaded, the cell's devices were never counted resident: its
    # tensors there were not moved off when another kernel got them (found in review).
    ns: dict[str, Any] = {}
    binder = TorchGpuBinder(lambda: ns, target=lambda _: torch.device("cpu"))
    monkeypatch.delitem(sys.modules, "torch")
    await binder.bind([1])
    assert binder.resident == ()
    monkeypatch.undo()  # the cell imports torch
    ns["w"] = torch.ones(2)
    await binder.release(evict=False)
    assert binder.resident == (1,)
    await binder.evict()
    assert binder.resident == ()


@requires_cuda
@pytest.mark.gpu
async def test_training_across_release_matches_one_process() -> None:
    reference = trained_namespace()
    for _ in range(3):
        train_step(reference, torch.device("cpu"))
    ns = trained_namespace()
    binder = TorchGpuBinder(lambda: ns)
    for _ in range(3):
        await binder.bind([0])
        assert ns["model"][0].weight.is_cuda and ns["alias"] is ns["model"][0].weight
        train_step(ns, binding.device())
        await binder.release(evict=True)
        assert not ns["model"][0].weight.is_cuda
        assert ns["model"][0].weight.is_pinned()
    for a, b in zip(ns["model"].parameters(), reference["model"].parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-4, atol=1e-5)


@requires_cuda
@pytest.mark.gpu
async def test_lazy_eviction_keeps_model_resident_until_evicted() -> None:
    ns = trained_namespace()
    binder = TorchGpuBinder(lambda: ns)
    await binder.bind([0])
    await binder.release(evict=False)
    assert ns["model"][0].weight.is_cuda
    await binder.bind([0])  # same device again: nothing moves
    assert ns["model"][0].weight.is_cuda
    await binder.release(evict=False)
    await binder.evict()  # another kernel takes the GPU
    assert not ns["model"][0].weight.is_cuda
