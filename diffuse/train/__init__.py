"""Training and evaluation of the package's default tiny model (tiny-wan-shapes).

    python -m diffuse.train            # train (CPU, ~1 hour), writes diffuse/trained/tiny-wan-shapes
    python -m diffuse.train evaluate   # property match rates on held-out prompts vs random weights
"""

import os

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trained", "tiny-wan-shapes")
