"""One ``diffuse query`` run as a typed request: what the flags ask, built once near the top and then handed
out in pieces.

``diffuse.cli.parsing.query_request`` checks the flags (``check_flags``: what the flags alone can tell) and builds a
``QueryRequest``; once the model's config is read, ``diffuse.cli.modelread.read_model`` checks it against what
the model is (``QueryRequest.check_for``) and puts the nodes heard on the network in for ``--nodes auto``.
From then on each part of the run takes only the piece it needs. The rules a request and a split's options
follow live here too (``check_options``), so the command line and ``diffuse.split`` follow the same ones.

- ``ModelAsk``: which model, where the client's ends compute, and whether it runs whole here;
- ``RingAsk``: where the nodes are and how the split runs (``diffuse.client.api.SplitOptions``);
- ``PipelineCall``: a diffusion pipeline's call (``diffuse.client.dryrun.call_kwargs``);
- ``TextCall``: a language model's inputs and ``generate``'s arguments (``diffuse.cli.language``);
- ``Output``: what the run writes, and whether it says what it does.

Nothing here imports torch or the model's library: the request exists before either loads.

>>> from diffuse.client.api import SplitOptions
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

import math
from dataclasses import dataclass, field, fields

from diffuse.errors import DiffuseError

FLAG_TO_ARG = {  # flag -> pipeline __call__ argument
    "prompt": "prompt", "negative_prompt": "negative_prompt", "steps": "num_inference_steps",
    "height": "height", "width": "width", "frames": "num_frames",
}
SIZE_ARGS = ("height", "width", "num_frames")  # the call's arguments that set its shapes


@dataclass(frozen=True)
class ModelAsk:
    """Which model (``--model``; None: the shipped one), where the client's ends compute (``--device``,
    ``--dtype``), its torch threads (``--threads``), whether it runs whole here (``--whole``), and the mode its
    own linear layers are held in (``--quantize-client``; None: as loaded), and the client's budget for the model's
    weights (``--client-memory``, ``diffuse.plan.budget``)."""

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    whole: bool = False
    quantize_client: str | None = None
    client_memory: str | None = None  # --client-memory: the most of the model's weights the client may hold


@dataclass(frozen=True)
class RingAsk:
    """Where the nodes are (``--nodes``, None: started here; ``auto``: heard on the network, listening
    ``discover_seconds``), and how the split runs (``diffuse.client.api.SplitOptions``)."""

    nodes: str | None
    discover_seconds: float | None
    options: object  # a diffuse.client.api.SplitOptions


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

    def check_for(self, autoregressive: bool) -> None:
        """The request against what the model's config says it is: a language model (``autoregressive``) or a
        diffusion pipeline. Checked after config.json is read, before the model loads."""
        o = self.ring.options
        check_options(o.patches, self.ring.nodes is not None, o.local_nodes, o.branch_groups, o.cache_threshold,
                      autoregressive)
        if autoregressive:
            for name in DIFFUSION_ONLY:
                if self.flag(name) not in (None, False):
                    raise DiffuseError(f"{flag(name)} applies to diffusion pipelines, not to a language model")
            return
        for name in LANGUAGE_ONLY:
            if self.flag(name) is not None:
                raise DiffuseError(f"{flag(name)} applies to language models, not to a diffusion pipeline")
        if any(self.flag(name) for name in LANGUAGE_MEDIA):
            raise DiffuseError("--image, --video, --media, --no-template and --embedding-on-node apply to language "
                               "models")


# ---------------------------------------------------------------- the rules a request follows

DIFFUSION_ONLY = ("steps", "height", "width", "frames", "negative_prompt", "save_array")
LANGUAGE_ONLY = ("max_new_tokens", "temperature", "top_p", "top_k", "save_tokens", "audio")
LANGUAGE_MEDIA = ("image", "video", "media", "no_template", "embedding_on_node")
NOT_FOR_LANGUAGE_MODELS = ("--cache-threshold applies to diffusion pipelines; a language model's passes carry a "
                           "key/value cache and are never skipped")


def flag(name: str) -> str:
    """A flag as typed, from its name as argparse keeps it: ``save_array`` -> ``--save-array``."""
    return "--" + name.replace("_", "-")


def checked_threshold(t) -> float:
    """``--cache-threshold``: a finite number >= 0 (0: off)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise DiffuseError(f"--cache-threshold {t!r}: must be a number of 0 or more (0: off; 0.1 skips steps "
                           "whose first block changes less than 10%)")
    return float(t)


def not_with_patches(patches: int) -> str:
    return (f"--cache-threshold and --patches {patches} do not go together: a skipped step has no patches to "
            "pipeline; choose one")


def check_options(patches: int, nodes_given: bool, local_nodes: int | None, branch_groups: int,
                  cache_threshold: float, autoregressive: bool | None = None) -> float:
    """The rules a split's options follow, for ``diffuse.split()`` and for the command line's flags alike (the
    command checks them through ``diffuse.cli.parsing.check_flags`` before anything loads). ``autoregressive``:
    whether the model is a language model, None while that is not known yet. Returns the cache threshold
    as a float."""
    if isinstance(patches, bool) or not isinstance(patches, int) or patches < 1:
        raise DiffuseError(f"--patches {patches!r}: must be a whole number, at least 1")
    if nodes_given and local_nodes is not None:
        raise DiffuseError("--nodes and --local-nodes: give one (nodes elsewhere, or nodes started here)")
    if local_nodes is not None and local_nodes < 1:
        raise DiffuseError("--local-nodes must be at least 1")
    if branch_groups < 1:
        raise DiffuseError("--branch-groups must be at least 1")
    asked = local_nodes if local_nodes is not None else 2 * branch_groups
    if not nodes_given and asked % branch_groups:
        raise DiffuseError(f"--local-nodes {asked} cannot be shared evenly by --branch-groups {branch_groups}")
    threshold = checked_threshold(cache_threshold) if cache_threshold else 0.0
    if threshold and patches > 1:
        raise DiffuseError(not_with_patches(patches))
    if autoregressive and threshold:
        raise DiffuseError(NOT_FOR_LANGUAGE_MODELS)
    if autoregressive and branch_groups > 1:
        raise DiffuseError("--branch-groups: branch groups run a diffusion model's guidance passes side by side; "
                           "a language model's passes go through one ring")
    if autoregressive and patches > 1:
        raise DiffuseError("--patches applies to diffusion pipelines; a language model runs one pass per token")
    return threshold
