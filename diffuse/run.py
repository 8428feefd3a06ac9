"""``python -m diffuse.run``: generate with a model split over a ring of nodes (``diffuse.cli.query``)."""

if __name__ == "__main__":
    from diffuse.cli.query import run_main

    run_main()
