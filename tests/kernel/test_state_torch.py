"""torch: tensors, a model and its optimizer survive the trip, and training goes on identically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nbos.kernel.state import namespace_digest
from tests.kernel.conftest import Pair, replay_in_child, sent_names

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.anyio

TRAIN_STEP = """
torch.manual_seed(7)
batch, target = torch.randn(16, 32), torch.randn(16, 1)
opt.zero_grad()
loss = torch.nn.functional.mse_loss(model(batch), target)
loss.backward()
opt.step()
"""


async def test_model_and_optimizer_train_on_identically_in_another_process(
    pair: Pair, tmp_path: Path
) -> None:
    await pair.cell(
        """
        import torch
        torch.set_num_threads(1)
        torch.manual_seed(0)

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.nn.Sequential(
                    torch.nn.Linear(32, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 1)
                )
            def forward(self, x):
                return self.body(x)

        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        """
    )
    delta = await pair.cell(TRAIN_STEP)
    assert {"model", "opt"} <= await sent_names(delta, pair.store)
    assert delta.blobs  # the 1 MiB first-layer weight and its Adam moments
    r = pair.replica
    assert r["opt"].param_groups[0]["params"][0] is r["model"].body[0].weight
    for mine, theirs in zip(
        pair.executor["model"].parameters(), r["model"].parameters(), strict=True
    ):
        assert torch.equal(mine, theirs)

    # thread count is process state, not namespace state: pin it where the step runs
    probe = "torch.set_num_threads(1)\n" + TRAIN_STEP
    probe += "result = [float(p.detach().sum()) for p in model.parameters()]\n"
    report = replay_in_child(pair, probe, tmp_path)
    assert report["digest"] == namespace_digest(pair.executor)
    exec(compile(probe, "<probe>", "exec", dont_inherit=True), pair.executor)
    assert report["probe"] == pair.executor.pop("result")
    assert report["after"] == namespace_digest(pair.executor)


async def test_tensor_kinds(pair: Pair) -> None:
    await pair.cell(
        """
        import torch
        f = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        bf = torch.ones(3, dtype=torch.bfloat16)
        b = torch.tensor([True, False])
        scalar = torch.tensor(3.5)
        empty = torch.empty(0, 4)
        t = f.t()
        leaf = torch.ones(2, requires_grad=True)
        leaf.sum().backward()
        view = f[1]
        """
    )
    r, e = pair.replica, pair.executor
    for name in ("f", "bf", "b", "scalar", "empty", "t", "view"):
        assert r[name].dtype == e[name].dtype and torch.equal(r[name], e[name]), name
    assert r["leaf"].requires_grad and torch.equal(r["leaf"].grad, torch.ones(2))
    assert torch.equal(r["t"], e["f"].t())


async def test_writes_that_bypass_the_version_counter_are_seen(pair: Pair) -> None:
    await pair.cell(
        f"""
        import torch
        p = torch.nn.Parameter(torch.zeros({1 << 19}))
        """
    )
    delta = await pair.cell("p.data[3] = 1.0")  # .data does not bump p._version
    assert "p" in await sent_names(delta, pair.store)
    assert float(pair.replica["p"].detach()[3]) == 1.0
    delta = await pair.cell("p.detach().numpy()[4] = 2.0")
    assert float(pair.replica["p"].detach()[4]) == 2.0


def test_state_package_imports_without_torch_or_numpy() -> None:
    code = (
        "import sys, nbos.kernel.state, nbos.core.wire; "
        "bad = [m for m in ('torch', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
