"""jupyter_kernel_test's conformance suite against the ``nbos`` kernelspec (real kernel manager).

The kernel manager starts the kernel through the nbos provisioner, so this covers the
kernelspec, the provisioner, the kernel host and the kernel front; every sample the suite
can use is given.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jupyter_kernel_test
import pytest

# The first kernel of a session may start the per-user gateway, its agents cold.
pytestmark = pytest.mark.timeout(300)


class NbosKernelTests(jupyter_kernel_test.KernelTests):  # type: ignore[misc]
    kernel_name = "nbos"
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples: ClassVar[list[dict[str, Any]]] = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples: ClassVar[list[str]] = [
        "1",
        "print('hello, world')",
        "def f(x):\n  return x*2\n\n\n",
    ]
    incomplete_code_samples: ClassVar[list[str]] = ['print("""hello', "def f(x):\n  x*2"]
    invalid_code_samples: ClassVar[list[str]] = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('nbos test error')"
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
    # "range" is left out: IPython answers a range query on the live session with session
    # number 0, not the number a tail query reported, so it fails for plain ipykernel too.
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"
