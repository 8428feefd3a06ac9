"""The pipeline's call run weightless, for the checks made before work starts (``diffuse.client.dryrun``).

``DryPipeline.run`` runs the pipeline's ``__call__`` on a copy of it whose denoiser
is rebuilt from its config on the meta device: its tensors have shapes and no
data, so its forward costs milliseconds, reads no weight and starts no node.
The rest of the call is the pipeline's own (the prompt is encoded once, and
kept for the further probes and for the real call), and it stops once the first
denoiser call has gone through the denoiser's own forward at the call's shapes
(or at the scheduler's first step, whichever comes first): ``_Refused`` where
that forward refuses the shapes, ``_Skip`` where the dry call cannot stand for
the real one (an operation with no meta kernel, a pipeline that reads a
tensor's values before its first step).

The same dry call watches each block stack of the denoiser (``NotAChain``): its
blocks must be called in list order, each handed every tensor the block before
it returned, untouched. That is what lets one pass through the nodes stand for
the whole stack; a denoiser that adds to a block's output before the next block
or keeps each block's output is refused here, in one line, before any node
starts. (Wan VACE, which does both, says so in its config and is refused
earlier, at analysis: ``analyzers/side_stacks.py``.)

Each watched stack is shown to the model as the split run shows it, a
``WeightlessStack`` of ``BlockProxy`` modules (``diffuse.client.proxies``): what
the model reads of a block outside the loop is answered as the split run answers
it, and a read the split run refuses (a block's weights' values, a call into a
block: ``ReadsBlocks``) is refused here, before any node starts.
"""

from __future__ import annotations

from diffuse.errors import ReadsBlocks
from diffuse.errors import DiffuseError


class _FirstStep(Exception):
    """The first denoiser call went through (or the scheduler's first step came first): the call's shapes fit."""


class _Refused(Exception):
    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class NotAChain(DiffuseError):
    """A stack's blocks, in the dry call, were not called as a chain: in list order, each handed what the one
    before it returned, as it returned it (the stand-in answers for all of them at once)."""


def _watch_chains(meta, stacks: list[str]) -> list:
    """Hooks on each stack of the weightless denoiser that raise ``NotAChain`` where the denoiser calls a block
    out of order, or calls it without every tensor the block before returned, untouched (work between blocks,
    such as a residual added after some of them, or a block's output used elsewhere than in the next block's
    call); the hooks, to remove."""
    from diffuse.plan.calltree import encode_value, flatten

    hooks = []
    for path in stacks:
        try:
            blocks = meta.get_submodule(path)
        except AttributeError:
            continue
        seen = {"next": 0, "out": []}

        def before(module, args, kwargs, i, path=path, seen=seen):
            if i and i != seen["next"]:
                raise NotAChain(f"{path}[{i}] is called after {path}[{seen['next'] - 1}]: the denoiser does not run "
                                "this stack as a chain in list order, so it cannot be split")
            try:
                given = {id(t) for t in flatten(args, kwargs)[1]}
            except DiffuseError:  # a call that cannot travel: the split says so itself, not this check
                return
            if i and any(id(t) not in given for t in seen["out"]):
                raise NotAChain(f"the denoiser does not hand {path}[{i}] what {path}[{i - 1}] returned, as it "
                                f"returned it (it works between the blocks, e.g. adds something to their output, or "
                                f"uses a block's output elsewhere): {path} is not a plain chain, so it cannot be split")

        def after(module, args, kwargs, out, i, seen=seen):
            try:
                outs = encode_value(out)[1]
            except DiffuseError:  # an answer that cannot travel: the split says so itself, not this check
                outs = []
            seen["next"], seen["out"] = i + 1, outs

        for i, block in enumerate(blocks):
            hooks.append(block.register_forward_pre_hook(
                lambda m, a, k, i=i, f=before: f(m, a, k, i), with_kwargs=True))
            hooks.append(block.register_forward_hook(
                lambda m, a, k, o, i=i, f=after: f(m, a, k, o, i), with_kwargs=True))
    return hooks


def _meta_copy(module):
    """``module`` rebuilt from its config on the meta device (no weights, no memory), or None."""
    import torch

    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        with torch.device("meta"):
            if hasattr(type(module), "from_config") and not hasattr(module, "generation_config"):
                return type(module).from_config(config)  # diffusers
            return type(module)(config)  # transformers
    except Exception:
        return None


class DryPipeline:
    """A pipeline's call with its denoiser weightless: see the module's docstring."""

    def __init__(self, pipe, denoiser: str, stacks: list[str] = ()):
        self.pipe, self.denoiser = pipe, denoiser
        self.meta = _meta_copy(getattr(pipe, denoiser, None))
        if self.meta is None:
            raise _Skip(f"{denoiser} cannot be rebuilt from its config")
        self.stacks = list(stacks)  # watched: their blocks must be called as a chain (``NotAChain``)
        _as_split(self.meta, self.stacks)
        self.prompt: tuple | None = None  # encode_prompt's (args, kwargs, answer), kept from the first call

    def run(self, kwargs: dict) -> None:
        """The call with ``kwargs`` up to its first scheduler step. Raises ``_Refused`` when the denoiser's
        forward refuses these shapes, ``_Skip`` when the dry call cannot tell."""
        import copy

        import torch

        dry = copy.copy(self.pipe)
        dry.__dict__ = dict(self.pipe.__dict__)
        scheduler = copy.deepcopy(self.pipe.scheduler)

        def first_step(*_, **__):
            raise _FirstStep()

        scheduler.step = first_step
        object.__setattr__(dry, "scheduler", scheduler)
        meta, forward = self.meta, type(self.meta).forward

        def checked_forward(*args, **kw):
            to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
            hooks = _watch_chains(meta, self.stacks)
            try:
                forward(meta, *map(to_meta, args), **{k: to_meta(v) for k, v in kw.items()})
            except (NotAChain, ReadsBlocks):
                raise
            except Exception as exc:
                raise _Refused(exc) from None
            finally:
                for h in hooks:
                    h.remove()
            raise _FirstStep()  # the first call went through at these shapes

        meta.forward = checked_forward
        object.__setattr__(dry, self.denoiser, meta)
        encode = getattr(self.pipe, "encode_prompt", None)
        if encode is not None:
            def kept(*args, **kw):
                if self.prompt is None:
                    self.prompt = (args, kw, encode(*args, **kw))
                return _cloned(self.prompt[2])  # what the dry call does to them leaves the kept answer as it was

            object.__setattr__(dry, "encode_prompt", kept)
        kwargs = dict(kwargs, generator=torch.Generator("cpu").manual_seed(0))
        try:
            with torch.no_grad():
                type(self.pipe).__call__(dry, **kwargs)
        except (_FirstStep, NotAChain, ReadsBlocks) as done:
            if not isinstance(done, _FirstStep):
                raise
            return
        except _Refused as r:
            if "meta" in str(r.cause).lower():  # no meta kernel, or a value read: the dry call cannot tell
                raise _Skip(str(r.cause)) from None
            raise
        except Exception as exc:
            raise _Skip(f"{type(exc).__name__}: {exc}") from None
        finally:
            del meta.forward
        raise _Skip("the call ended without a scheduler step")


def _as_split(meta, stacks: list[str]) -> None:
    """Each of ``stacks`` in the weightless denoiser ``meta`` replaced by a ``WeightlessStack``: the model sees
    proxies where the split run shows it proxies (its blocks called behind them, here)."""
    from diffuse.client.proxies import WeightlessStack

    found = []
    for path in stacks:  # every stack found before any is replaced (one may hold another's path)
        parent_path, _, name = path.rpartition(".")
        try:
            parent = meta.get_submodule(parent_path) if parent_path else meta
            found.append((parent, name, path, getattr(parent, name)))
        except AttributeError:
            continue
    for parent, name, path, blocks in found:
        setattr(parent, name, WeightlessStack(path, blocks))


def _cloned(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(v) for v in value)
    return value


class _Skip(Exception):
    """The dry call cannot stand for the real one here."""
