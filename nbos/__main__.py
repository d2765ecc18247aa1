import sys

from nbos.cli.main import main

sys.exit(main())
