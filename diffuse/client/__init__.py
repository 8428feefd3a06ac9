"""The client process: the pipeline's (or ``generate``'s) own code runs here, its block stacks replaced by
stand-ins that send hidden states through a ring of nodes.

``api`` is ``diffuse.split`` and ``diffuse.from_pretrained``, the one path every run is assembled by;
``standin`` and ``proxies`` are what the model calls where its stacks were; ``ring``, ``channel`` and
``handshake`` one session through the nodes; ``heard`` what the nodes said and the links measured, which
``routing`` plans routes from and ``repair`` re-plans after a failure (``replay`` resends what was lost);
``branches`` runs guidance branches on separate groups; ``dryrun`` and ``weightless`` check sizes before
work starts; ``output`` and ``writers`` write the result. Nothing here imports the node.
"""
