"""The kernelspec's command starts without a word on stderr (issue 30)."""

from __future__ import annotations

import os
import subprocess

from nbos.jupyter import kernel_json
from tests.agent._daemons import DEADLINE, ROOT


def test_the_kernelspecs_command_imports_its_module_once_without_a_warning() -> None:
    # The package's provisioner imported the host module before ``-m`` ran it: Python's
    # RuntimeWarning "'nbos.jupyter.host' found in sys.modules" on every kernel start.
    argv = [a for a in kernel_json()["argv"] if a != "{connection_file}"]
    done = subprocess.run(
        [*argv[: argv.index("-f")], "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=DEADLINE,
        check=False,
    )
    assert done.returncode == 0 and "--connection-file" in done.stdout, done.stderr
    assert done.stderr == ""
