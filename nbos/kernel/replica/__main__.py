"""``python -m nbos.kernel.replica``: one replica kernel process."""

import gc
import sys

if sys.argv[1:] == ["--template"]:  # TEMPLATE_FLAG, whose module's imports come after
    # Before the imports: objects the collector frees would leave holes in the pages
    # the template's forks share, which their own objects then fill (and copy).
    gc.disable()

from nbos.kernel.replica._app import main

main()
