"""jupyter_kernel_test's conformance suite against the ``nbos`` kernelspec (real kernel manager)."""

from __future__ import annotations

import jupyter_kernel_test


class NbosKernelTests(jupyter_kernel_test.KernelTests):
    kernel_name = "nbos"
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]  # noqa: RUF012
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]  # noqa: RUF012
    incomplete_code_samples = ['print("""hello', "def f(x):\n  x*2"]  # noqa: RUF012
    invalid_code_samples = ["import = 7q"]  # noqa: RUF012
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('nbos test error')"
    code_execute_result = [{"code": "1+2+3", "result": "6"}]  # noqa: RUF012
    code_display_data = [  # noqa: RUF012
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>x</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    # IPython answers a range query on the live session with session number 0, not
    # the number a tail query reported, so "range" fails for plain ipykernel too.
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"
