"""Where the kernel host leaves the front's connection info for the provisioner.

Apart from :mod:`nbos.jupyter.host` so that the provisioner, which the package imports,
does not import the host: ``python -m nbos.jupyter.host`` would then find its own module
imported before it runs (Python's ``RuntimeWarning: 'nbos.jupyter.host' found in
sys.modules``, on every kernel start).
"""

from __future__ import annotations

from pathlib import Path


def front_info_path(connection_file: Path) -> Path:
    """Where the host writes the front's connection info for ``connection_file``."""
    return connection_file.with_name(connection_file.name + ".front")
