"""``python -m shim.patches --write | --check``: regenerate (or check) the catalogue's index."""

import sys

from shim.catalogue import main

sys.exit(main())
