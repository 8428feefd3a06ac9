"""The node process: it holds slices of a model's block stacks and serves them (``python -m diffuse.node``).

``server`` reads the command line and runs the two threads: ``control`` answers hello, open and close;
``compute`` opens the data messages it admitted and runs each through the session's ``stage``, several
decoding passes at once by ``batches``. ``blockstore`` reads only this node's blocks from the files;
``sessions`` is the table of who opened what. Nothing here imports the client.
"""
