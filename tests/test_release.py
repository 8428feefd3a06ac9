"""A split is undone on release: the model holds its own modules and hooks again, and runs as it did once its
handed-out weights are loaded again (``diffuse.changes``, ``diffuse.client.standin.Splitter.release``)."""

from __future__ import annotations

import pytest
import torch

from conftest import THREADS


# attributes left out: the splitter kept on the model (what its first calls taught), and the hook registry
# diffusers makes on a denoiser at the pipeline's first call (``cache_context``), split or not
NOT_COMPARED = ("_diffuse_splitter", "_diffusers_hook")


def model_layout(model: torch.nn.Module) -> list:
    """Every module of ``model`` by name (the object itself, and its class), and the attributes set on the
    instance (but ``NOT_COMPARED``)."""
    return [(name, id(m), type(m).__name__, sorted(k for k in vars(m) if k not in NOT_COMPARED))
            for name, m in model.named_modules(remove_duplicate=False)]


def hooks_of(model: torch.nn.Module) -> dict:
    """The forward hooks registered on each module of ``model``, by module name."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
             "_forward_hooks_always_called")
    return {name: [(kind, k, id(h)) for kind in kinds for k, h in getattr(m, kind).items()]
            for name, m in model.named_modules(remove_duplicate=False)}


def only_refusals_added(model: torch.nn.Module, hooks: dict) -> bool:
    """Whether the hooks of ``model`` are ``hooks`` but for one more on each module whose weights are freed (on
    the meta device): the refusal that says so (``diffuse.changes.guard``)."""
    now = hooks_of(model)
    for name, m in model.named_modules(remove_duplicate=False):
        freed = any(p.device.type == "meta" for p in m.parameters())
        extra = [h for h in now[name] if h not in hooks[name]]
        if [h for h in hooks[name] if h not in now[name]] or len(extra) > freed \
                or (extra and extra[0][0] != "_forward_pre_hooks"):
            return False
    return True


def reloaded(model: torch.nn.Module, saved: dict) -> None:
    """The weights a split handed to nodes loaded again, as a user reloads them."""
    model.load_state_dict(saved, assign=True)


def test_a_split_language_model_is_its_own_model_again_after_release(tmp_path, diffuse_home):
    import lm_models

    import diffuse
    from diffuse.lm.client_media import build_inputs

    model_dir = lm_models.build("qwen2", str(tmp_path / "qwen2"))
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        model = diffuse.from_pretrained(model_dir)
        inputs, _ = build_inputs(model_dir, "The moon")
        with torch.no_grad():
            before = model(**inputs).logits
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        layout, hooks = model_layout(model), hooks_of(model)
        with diffuse.split(model, local_nodes=2, embedding_on_node=True):  # the embedding's stand-in too
            during, hooked = model_layout(model), hooks_of(model)
            split = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        # while split, the layers, the head and the embedding were stand-ins and every module was watched
        assert during != layout and len(during) < len(layout) and hooked != hooks
        # released: its own modules, no attribute left; the weights the nodes held are freed here, and the
        # modules that held them refuse to run, saying so, until they are loaded again
        assert model_layout(model) == layout and only_refusals_added(model, hooks)
        assert hooks_of(model) != hooks
        with pytest.raises(diffuse.DiffuseError, match="held by the first node"):
            model(**inputs)
        reloaded(model, saved)
        with torch.no_grad():
            after = model(**inputs).logits
            whole = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert torch.equal(after, before)
        assert torch.equal(whole, split)  # and the model whole makes the tokens the split made
        assert model_layout(model) == layout and hooks_of(model) == hooks  # the refusals went with the weights' return
    finally:
        torch.set_num_threads(threads)
