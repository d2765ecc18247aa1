"""jupyter_kernel_test's protocol suite against a replicated kernel's front.

It connects to the front of a kernel on an embedded cluster (the kernelspec and
provisioner path is tested elsewhere); every sample the suite can use is given.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, ClassVar

import jupyter_kernel_test
from jupyter_client.blocking.client import BlockingKernelClient

import nbos


class ReplicatedKernelTests(jupyter_kernel_test.KernelTests):  # type: ignore[misc]
    _stack: ClassVar[ExitStack]

    @classmethod
    def setUpClass(cls) -> None:
        cls._stack = ExitStack()
        cluster = cls._stack.enter_context(nbos.connect_blocking(hosts=3, durable=False))
        kernel = cluster.start_kernel()
        client = BlockingKernelClient()
        client.load_connection_info(kernel.connection_info)
        client.start_channels()
        client.wait_for_ready(timeout=30)
        cls._stack.callback(client.stop_channels)
        cls.kc = client

    @classmethod
    def tearDownClass(cls) -> None:
        cls._stack.close()

    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('oops', file=sys.stderr)"
    completion_samples: ClassVar[list[dict[str, Any]]] = [
        {"text": "zi", "matches": {"zip"}},
    ]
    complete_code_samples: ClassVar[list[str]] = [
        "1",
        "print('hello, world')",
        "def f(x):\n  return x*2\n\n",
    ]
    incomplete_code_samples: ClassVar[list[str]] = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples: ClassVar[list[str]] = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('nbos')"
    code_execute_result: ClassVar[list[dict[str, str]]] = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data: ClassVar[list[dict[str, str]]] = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>x</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math(r'\\alpha'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    # "range" is left out: IPython answers a range of the current session with session
    # number 0, which the suite's range check refuses for plain ipykernel too.
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"
