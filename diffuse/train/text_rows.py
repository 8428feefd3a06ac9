"""The text side of training the transformer (``diffuse.train.trainer``): each prompt's embedding rows from the
frozen text encoder, and ``PadBias``, the exact, cheap stand-in for the pipeline's zero-padded rows."""

from __future__ import annotations

import math

import torch

TEXT_ROWS = 8  # text rows used in training; see PadBias


# ---------------------------------------------------------------------------
# Exact, cheap stand-in for 512 padded text rows during training.
#
# WanPipeline pads every prompt embedding with zero rows up to
# max_sequence_length (512). Zero rows are all mapped to the same key/value in
# every cross-attention, and n identical keys under softmax equal one key with
# log(n) added to its logit. So training on TEXT_ROWS rows, with a bias of
# log((512 - r) / (TEXT_ROWS - r)) on each of the (TEXT_ROWS - r) zero rows,
# computes exactly what the transformer computes on the pipeline's 512 rows —
# three times cheaper on CPU. Only used during training; the shipped model is
# plain diffusers.
# ---------------------------------------------------------------------------
class PadBias:
    def __init__(self, inner):
        self.inner = inner
        self.bias = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.bias, rotary_emb)


def install_pad_bias(transformer) -> list[PadBias]:
    procs = []
    for blk in transformer.blocks:
        p = PadBias(blk.attn2.processor)
        blk.attn2.set_processor(p)
        procs.append(p)
    return procs


def remove_pad_bias(transformer, procs):
    for blk, p in zip(transformer.blocks, procs):
        blk.attn2.set_processor(p.inner)


def encode_prompts(tokenizer, text_encoder, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Per prompt: the embedding rows WanPipeline keeps (before zero padding)."""
    out = {}
    with torch.no_grad():
        for p in prompts:
            t = tokenizer([p], padding="max_length", max_length=TEXT_ROWS, truncation=True,
                          add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
            n = int(t.attention_mask.sum())
            e = text_encoder(t.input_ids, t.attention_mask).last_hidden_state[0, :n]
            out[p] = e.float()
    return out


def text_batch(embs: dict, prompts: list[str], max_len: int):
    rows, biases = [], []
    for p in prompts:
        e = embs[p]
        r = e.shape[0]
        pad = TEXT_ROWS - r
        rows.append(torch.cat([e, e.new_zeros(pad, e.shape[1])]))
        b = torch.zeros(TEXT_ROWS)
        b[r:] = math.log((max_len - r) / pad)
        biases.append(b)
    return torch.stack(rows), torch.stack(biases)[:, None, None, :]
