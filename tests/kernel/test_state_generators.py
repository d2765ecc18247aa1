"""Process-wide state outside the namespace: global generators, working directory, environment."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from nbos.kernel.state import ProcessState, dump_namespace, image_process
from nbos.store.local import LocalObjectStore
from tests.kernel.conftest import run_json

pytestmark = pytest.mark.anyio


@pytest.fixture
def restore_process() -> Iterator[None]:
    """Put back the cwd and the global generator the test changed."""
    cwd, state = os.getcwd(), random.getstate()
    yield
    os.chdir(cwd)
    random.setstate(state)


@pytest.mark.usefixtures("restore_process")
def test_a_part_travels_once_and_only_when_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBOS_TEST_GONE", "x")
    process = ProcessState()
    first = process.capture()
    # The generators start unknown; the cwd and environment start as this process's.
    assert "random" in first and "cwd" not in first
    assert not [n for n in first if n.startswith("env:")]
    assert process.capture() == {}
    random.random()
    monkeypatch.setenv("NBOS_TEST_SET", "1")
    monkeypatch.delenv("NBOS_TEST_GONE")
    os.chdir(tmp_path)
    assert process.capture() == {
        "random": pickle.dumps(random.getstate()),
        "env:NBOS_TEST_SET": b"1",
        "env:NBOS_TEST_GONE": None,
        "cwd": os.fsencode(tmp_path),
    }
    assert process.capture() == {}


@pytest.mark.usefixtures("restore_process")
def test_a_value_set_back_to_an_earlier_one_travels_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reads of unchanged parts are remembered (most cells change none): going back to
    # an earlier value is still a change.
    process = ProcessState()
    process.capture()
    earlier = random.getstate()
    for value in ("1", "2", "1"):
        monkeypatch.setenv("NBOS_TEST_BACK", value)
        assert process.capture() == {"env:NBOS_TEST_BACK": value.encode()}
    random.random()
    assert list(process.capture()) == ["random"]
    random.setstate(earlier)
    assert process.capture() == {"random": pickle.dumps(earlier)}
    changed = process.current()
    changed["env:NBOS_TEST_BACK"] = b"poisoned"  # a caller's copy, not what is remembered
    assert process.current()["env:NBOS_TEST_BACK"] == b"1"


@pytest.mark.usefixtures("restore_process")
def test_applied_parts_are_not_sent_back_and_generators_count_in_the_digest(
    tmp_path: Path,
) -> None:
    executor, replica = ProcessState(), ProcessState()
    random.seed(7)
    os.chdir(tmp_path)
    parts = executor.capture()
    replica.apply(parts)
    assert replica.capture() == {}
    assert replica.digest() == executor.digest() != ProcessState().digest()
    before = executor.digest()
    random.random()
    assert executor.digest() != before


def test_numpy_and_torch_are_neither_imported_nor_read_unless_a_cell_did() -> None:
    probe = textwrap.dedent(
        """
        import json, random, sys
        from nbos.kernel.state import ProcessState
        parts = ProcessState().capture()
        print(json.dumps({"parts": sorted(parts), "modules": sorted(
            m for m in ("numpy", "numpy.random", "torch") if m in sys.modules)}))
        """
    )
    report = run_json(["-c", probe])
    assert report == {"parts": ["random"], "modules": []}


def test_another_process_draws_what_the_executor_would_have(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import json, pickle, random, sys
        import numpy as np
        import torch
        from nbos.kernel.state import ProcessState
        process = ProcessState()
        if sys.argv[1] == "seed":
            random.seed(3); np.random.seed(3); torch.manual_seed(3)
            sys.stdout.buffer.write(pickle.dumps(process.capture()))
        else:
            with open(sys.argv[2], "rb") as f:
                process.apply(pickle.load(f))
            print(json.dumps([random.random(), float(np.random.rand()), torch.rand(1).item()]))
        """
    )
    seeded = subprocess.run(
        [sys.executable, "-c", script, "seed"], capture_output=True, check=True, timeout=60
    )
    (tmp_path / "parts").write_bytes(seeded.stdout)
    drawn = run_json(["-c", script, "apply", str(tmp_path / "parts")])
    expected = [
        random.Random(3).random(),
        float(np.random.RandomState(3).rand()),
        torch.rand(1, generator=torch.Generator().manual_seed(3)).item(),
    ]
    assert drawn == expected


async def test_a_snapshot_image_keeps_the_process_parts(store: LocalObjectStore) -> None:
    parts: dict[str, bytes | None] = {"random": b"state", "env:GONE": None}
    image = await dump_namespace({"x": 1}, store, process=parts)
    assert image_process(image) == parts
    assert image_process(await dump_namespace({"x": 1}, store)) == {}


@pytest.mark.usefixtures("restore_process")
def test_an_image_keeps_what_cells_changed_and_restoring_it_undoes_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBOS_TEST_HOST_OWN", "this host")
    process = ProcessState()
    here = os.getcwd()
    random.seed(5)
    monkeypatch.setenv("NBOS_TEST_BY_CELL", "1")
    image = process.image()
    assert set(image) >= {"random", "env:NBOS_TEST_BY_CELL"}
    assert "env:NBOS_TEST_HOST_OWN" not in image and "cwd" not in image
    # A later cell's changes, then the process goes back to the image's state.
    random.random()
    os.chdir(tmp_path)
    monkeypatch.setenv("NBOS_TEST_LATER", "2")
    monkeypatch.delenv("NBOS_TEST_BY_CELL")
    process.capture()
    process.restore(image)
    assert os.getcwd() == here and "NBOS_TEST_LATER" not in os.environ
    assert os.environ["NBOS_TEST_BY_CELL"] == "1"
    assert random.getstate() == random.Random(5).getstate()
    assert process.capture() == {}
    # An empty image is the state at start, where the generators are nobody's yet.
    process.restore({})
    assert "NBOS_TEST_BY_CELL" not in os.environ
    assert process.digest() == ProcessState().digest()
