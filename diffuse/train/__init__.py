"""Training and evaluation of the package's tiny models (tiny-wan-shapes, tiny-qwen-chat).

    python -m diffuse.train                 # train (CPU, ~1 hour), writes diffuse/trained/tiny-wan-shapes
    python -m diffuse.train evaluate        # property match rates on held-out prompts vs random weights
    python -m diffuse.train chat            # train the chat model, writes diffuse/trained/tiny-qwen-chat
    python -m diffuse.train chat evaluate   # its held-out accuracy per task vs random weights
"""

import os

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trained", "tiny-wan-shapes")
