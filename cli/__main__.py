"""``python3 -m phloem.cli``: the ``phloem`` console script without installing it."""

import sys

from phloem.cli.main import main

sys.exit(main())
