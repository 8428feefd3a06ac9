"""A split is undone on release: the model holds its own modules and hooks again, and runs as it did once its
handed-out weights are loaded again (``diffuse.changes``, ``diffuse.standin.Splitter.release``)."""

from __future__ import annotations

import pytest
import torch

from conftest import THREADS


def model_layout(model: torch.nn.Module) -> list:
    """Every module of ``model`` by name (the object itself, and its class), the hooks registered on it, and the
    attributes set on the instance: what a split changes while it runs. The splitter kept on the model (what its
    first calls taught, ``_diffuse_splitter``) is left out."""
    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        hooks = {kind: [(k, id(h)) for k, h in getattr(m, kind).items()]
                 for kind in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                              "_forward_hooks_with_kwargs", "_forward_hooks_always_called")}
        attrs = sorted(k for k in vars(m) if k != "_diffuse_splitter")
        out.append((name, id(m), type(m).__name__, hooks, attrs))
    return out


def reloaded(model: torch.nn.Module, saved: dict) -> None:
    """The weights a split handed to nodes loaded again, as a user reloads them."""
    model.load_state_dict(saved, assign=True)


def test_a_split_language_model_is_its_own_model_again_after_release(tmp_path, diffuse_home):
    import lm_models

    import diffuse
    from diffuse.media_inputs import build_inputs

    model_dir = lm_models.build("qwen2", str(tmp_path / "qwen2"))
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        model = diffuse.from_pretrained(model_dir)
        inputs, _ = build_inputs(model_dir, "The moon")
        with torch.no_grad():
            before = model(**inputs).logits
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        layout = model_layout(model)
        with diffuse.split(model, local_nodes=2):
            during = model_layout(model)
            split = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        # while split, the layers, the head and the embedding were stand-ins and every module was watched
        assert during != layout and len(during) < len(layout)
        assert model_layout(model) == layout  # released: its own modules, no hook, no attribute left
        # the weights the nodes held are freed here, and the model says so until they are loaded again
        with pytest.raises(diffuse.DiffuseError, match="held by the first node"):
            model(**inputs)
        reloaded(model, saved)
        with torch.no_grad():
            after = model(**inputs).logits
            whole = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert torch.equal(after, before)
        assert torch.equal(whole, split)  # and the model whole makes the tokens the split made
        assert model_layout(model) == layout  # the refusal went with the weights' return
    finally:
        torch.set_num_threads(threads)
