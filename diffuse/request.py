"""One ``diffuse query`` run as a typed request: what the flags ask, built once near the top and then handed
out in pieces.

``diffuse.cli.query_request`` checks the flags (``check_flags``: what the flags alone can tell) and builds a
``QueryRequest``; once the model's config is read, ``diffuse.cli.request_for`` checks it against what the
model is and puts the nodes heard on the network in for ``--nodes auto``. From then on each part of the run
takes only the piece it needs:

- ``ModelAsk``: which model, where the client's ends compute, and whether it runs whole here;
- ``RingAsk``: where the nodes are and how the split runs (``diffuse.api.SplitOptions``);
- ``PipelineCall``: a diffusion pipeline's call (``diffuse.run.call_kwargs``);
- ``TextCall``: a language model's inputs and ``generate``'s arguments (``diffuse.lm``);
- ``Output``: what the run writes, and whether it says what it does.

Nothing here imports torch or the model's library: the request exists before either loads.

>>> from diffuse.api import SplitOptions
>>> call = PipelineCall(prompt="a fox", steps=4, height=64, args={"guidance_scale": 3})
>>> call.named()
{'prompt': ('prompt', 'a fox'), 'steps': ('num_inference_steps', 4), 'height': ('height', 64)}
>>> call.sizes()
{'height': 64}
>>> q = QueryRequest(ModelAsk(), RingAsk(None, None, SplitOptions()), call, TextCall(), Output())
>>> q.flag("steps"), q.flag("save_tokens")
(4, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

FLAG_TO_ARG = {  # flag -> pipeline __call__ argument
    "prompt": "prompt", "negative_prompt": "negative_prompt", "steps": "num_inference_steps",
    "height": "height", "width": "width", "frames": "num_frames",
}
SIZE_ARGS = ("height", "width", "num_frames")  # the call's arguments that set its shapes


@dataclass(frozen=True)
class ModelAsk:
    """Which model (``--model``; None: the shipped one), where the client's ends compute (``--device``,
    ``--dtype``), its torch threads (``--threads``), and whether it runs whole here (``--whole``)."""

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    whole: bool = False


@dataclass(frozen=True)
class RingAsk:
    """Where the nodes are (``--nodes``, None: started here; ``auto``: heard on the network, listening
    ``discover_seconds``), and how the split runs (``diffuse.api.SplitOptions``)."""

    nodes: str | None
    discover_seconds: float | None
    options: object  # a diffuse.api.SplitOptions


@dataclass(frozen=True)
class PipelineCall:
    """A diffusion pipeline's call: the flags that name its arguments (None: not given, the pipeline's own
    default holds), every ``--arg KEY=VALUE`` parsed in order, and the seed of its generator."""

    prompt: str | None = None
    negative_prompt: str | None = None
    steps: int | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    args: dict = field(default_factory=dict)
    seed: int = 0

    def named(self) -> dict[str, tuple[str, object]]:
        """Each flag given: flag -> (the pipeline's argument, the value)."""
        return {flag: (arg, getattr(self, flag)) for flag, arg in FLAG_TO_ARG.items()
                if getattr(self, flag) is not None}

    def sizes(self) -> dict[str, int]:
        """The call's shape arguments given by flag: argument -> value."""
        return {arg: value for arg, value in self.named().values() if arg in SIZE_ARGS}


@dataclass(frozen=True)
class TextCall:
    """A language model's inputs (a prompt, images and videos before it, or a clip to hear) and what
    ``generate`` is asked (None: the model's generation config holds)."""

    prompt: str | None = None
    image: tuple[str, ...] = ()
    video: tuple[str, ...] = ()
    media: tuple[str, ...] = ()
    audio: str | None = None
    no_template: bool = False
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    args: dict = field(default_factory=dict)
    seed: int = 0


@dataclass(frozen=True)
class Output:
    """What the run writes (``--out``, ``--save-array``, ``--save-tokens``, ``--report``), and ``quiet``: no
    status lines, notes or progress."""

    out: str | None = None
    save_array: str | None = None
    save_tokens: str | None = None
    report: str | None = None
    quiet: bool = False


@dataclass(frozen=True)
class QueryRequest:
    """One run of ``diffuse query``, in the pieces its parts take."""

    model: ModelAsk
    ring: RingAsk
    call: PipelineCall
    text: TextCall
    output: Output

    def flag(self, name: str):
        """The value of flag ``name`` (as argparse spells it: ``save_array``), in whichever piece keeps it (the
        split's options last); for the checks that hold a flag against what the model is."""
        for piece in (self.call, self.text, self.output, self.model, self.ring.options):
            if name in {f.name for f in fields(piece)}:
                return getattr(piece, name)
        raise KeyError(name)
