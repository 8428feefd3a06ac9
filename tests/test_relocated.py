"""Checkpoints that keep a stack under another name than the model's class gives it still split: nodes find
the blocks by their count and shapes. References: plain diffusers / transformers on the original folders,
in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import families
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from conftest import TESTS, THREADS, reference_loads, run_client, run_split, subprocess_env


def _relocate(src: str, dst: str, weights: str, rename) -> str:
    """A copy of the model folder ``src`` whose ``weights`` file has every key passed through ``rename``."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, weights)
    tensors = load_file(path)
    save_file({rename(k): v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return dst


def test_a_diffusion_stack_kept_under_another_prefix_runs_byte_identical(models, tmp_path, diffuse_home):
    model = models("wan")
    moved = _relocate(model, str(tmp_path / "wan-moved"), "transformer/diffusion_pytorch_model.safetensors",
                      lambda k: "trunk.layers." + k[len("blocks."):] if k.startswith("blocks.") else k)
    kwargs = families.call_args("wan")
    reference = reference_loads(model, kwargs, str(tmp_path / "whole.npy"))[0]  # the original folder, whole
    split, _ = run_split(moved, kwargs, tmp_path, nodes=2, home=diffuse_home)
    assert split.tobytes() == reference.tobytes()


def test_a_stack_whose_blocks_cannot_be_told_apart_by_shape_is_refused_in_one_line(models, tmp_path,
                                                                                   diffuse_home):
    """Inner names changed as well: a Wan block holds several tensors of one shape, so shapes cannot say
    which is which, and the node refuses rather than guess."""
    model = models("wan")

    def rename(k):
        if not k.startswith("blocks."):
            return k
        i, rest = k[len("blocks."):].split(".", 1)
        return f"trunk.{i}.{rest.replace('attn1', 'self_attention').replace('to_q', 'query')}"

    moved = _relocate(model, str(tmp_path / "wan-scrambled"), "transformer/diffusion_pytorch_model.safetensors",
                      rename)
    argv = ["--model", moved, "--prompt", "a cat", "--steps", "1", "--local-nodes", "2", "--quiet",
            "--out", str(tmp_path / "o.mp4")]
    run = run_client(argv, diffuse_home)
    assert run.returncode == 2
    assert "does not hold blocks under its own names" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_a_language_model_with_its_layers_under_another_prefix_answers_token_for_token(tmp_path_factory,
                                                                                      diffuse_home):
    import lm_models

    root = tmp_path_factory.mktemp("relocated-lm")
    model = lm_models.build("qwen2", str(root / "qwen2"))
    moved = _relocate(model, str(root / "qwen2-moved"), "model.safetensors",
                      lambda k: k.replace("model.layers.", "model.decoder.stack.", 1))
    prompt = "Tell me a story about the moon."
    ref_out = root / "reference.json"
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "lm_reference.py"), "--model", model, "--prompt",
                           prompt, "--max-new-tokens", "6", "--threads", str(THREADS), "--out", str(ref_out)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = root / "tokens.json"
    run = run_client(["--model", moved, "--prompt", prompt, "--max-new-tokens", "6", "--local-nodes", "2",
                      "--threads", str(THREADS), "--save-tokens", str(tokens), "--quiet"], diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(ref_out) as f, open(tokens) as g:
        ref, got = json.load(f), json.load(g)
    assert got["input_ids"] == ref["input_ids"] and got["new_tokens"] == ref["new_tokens"]
    assert np.asarray(got["new_tokens"]).size == 6


def test_the_client_loads_no_block(models):
    """Wan's pipeline declares its transformer optional, and diffusers then loads it from disk even when one
    is handed in: the client must still never read the blocks the nodes hold, the first of each stack included
    (it learns the stack's call at the first step weightless, or with zero weights)."""
    import diffuse

    pipe = diffuse.from_pretrained(models("wan"))
    devices = [next(b.parameters()).device.type for b in pipe.transformer.blocks]
    assert set(devices) == {"meta"}, devices
