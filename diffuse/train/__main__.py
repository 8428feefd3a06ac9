"""Train the tiny Wan text-to-video model on procedural shapes (CPU); polish or evaluate a trained one.

commands (each takes --help):
  python -m diffuse.train [options]                 train from scratch (the defaults made ``tiny-wan-shapes``)
  python -m diffuse.train evaluate [options]        held-out property match rates, against random weights
  python -m diffuse.train polish-decoder [options]  train only a saved model's VAE decoder (encoder frozen)
  python -m diffuse.train chat [evaluate|card] ...  the tiny chat model (tiny-qwen-chat): train, evaluate, card
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "chat":
        from .chat import main as chat

        return chat(argv[1:])
    if argv and argv[0] == "evaluate":
        from .evaluate import main as ev

        return ev(argv[1:])
    if argv and argv[0] == "polish-decoder":
        from .trainer import polish_saved

        pp = argparse.ArgumentParser(prog="python -m diffuse.train polish-decoder",
                                     description="Train only the VAE decoder of a saved model (encoder frozen).")
        pp.add_argument("--model", default=None)
        pp.add_argument("--steps", type=int, default=300)
        pp.add_argument("--seed", type=int, default=0)
        pp.add_argument("--threads", type=int, default=1)
        pa = pp.parse_args(argv[1:])
        from . import DEFAULT_MODEL

        polish_saved(pa.model or DEFAULT_MODEL, pa.steps, pa.seed, pa.threads)
        return 0
    from .trainer import TrainConfig, quick_config, run

    from diffuse.text import plain

    ap = argparse.ArgumentParser(prog="python -m diffuse.train", description=plain(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import DEFAULT_MODEL

    ap.add_argument("--out", default=DEFAULT_MODEL, help="pipeline folder to write (default: the shipped model)")
    ap.add_argument("--steps", type=int, default=None, help="transformer steps")
    ap.add_argument("--vae-steps", type=int, default=None)
    ap.add_argument("--decoder-steps", type=int, default=None, help="VAE decoder polish steps after the transformer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--per-combo", type=int, default=None, help="clips per training prompt")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="cap the transformer phase at this many minutes (the LR schedule follows the clock)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few dozen steps (for tests)")
    a = ap.parse_args(argv)
    kw = dict(steps=a.steps, vae_steps=a.vae_steps, decoder_steps=a.decoder_steps, seed=a.seed, threads=a.threads,
              batch=a.batch, per_combo=a.per_combo, time_budget_min=a.time_budget)
    if a.quick:
        cfg = quick_config(a.out, **kw)
    else:
        cfg = TrainConfig(out=a.out)
        for k, v in kw.items():
            if v is not None:
                setattr(cfg, k, v)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
