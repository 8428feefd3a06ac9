"""Language models split over a ring, one side per file.

``client_*`` files run in the client: the ends ``generate`` calls (``client_ends``: the layers' stand-in,
the embedding and head stand-ins, the cache object), the prompt's media and audio inputs, and what a run
reports. ``node_*`` files run on a node: its layers with their caches, the tail and the draw on the last
node, several sessions' decoding passes as one batch. The rest (``heads``, ``embedding``, ``sampling``)
is what both sides read: where a model keeps its head and embedding, and how the processors travel.
A ``client_*`` file never imports a ``node_*`` file, nor the other way round.
"""
