"""``python -m nbos.kernel.replica``: one replica kernel process."""

from nbos.kernel.replica._app import main

main()
