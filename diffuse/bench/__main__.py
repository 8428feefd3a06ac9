"""``python -m diffuse.bench [NAME]``: run a benchmark (``diffuse.bench.command``)."""

import sys

from diffuse.bench.command import main

sys.exit(main())
