"""A model that composes audio from text (MusicGen): its ``generate`` returns the waveform its codec decoded,
written as .wav; split, its decoder's layers run on the nodes and the codes are picked on the last one. The
codes it decoded are kept for ``--save-tokens``. Called by ``diffuse.cli.language.generate_text`` once the model has
loaded (``audio_rate``: a model whose config names an audio codec composes)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace

from diffuse.errors import DiffuseError
from diffuse.lm.client_report import head_params_held
from diffuse.client.request import QueryRequest

def audio_rate(model) -> int | None:
    """The sampling rate of the audio a model's ``generate`` returns (its audio codec's), or None for text."""
    codec = getattr(model.config, "audio_encoder", None)
    rate = getattr(codec, "sampling_rate", None)
    return int(rate) if rate else None


def compose_audio(q: QueryRequest, console, info, model, inputs, gen, times, t0) -> dict:
    """A model that writes audio (MusicGen): ``generate`` returns the waveform its codec decoded; the codes it
    decoded (exactly as handed to the codec) are kept for ``--save-tokens``."""
    import torch

    from diffuse.cli.ringopen import open_split
    from diffuse.plan.plugins import call_hook
    from diffuse.client.writers import OutputInfo

    codec = model.audio_encoder
    codes: list = []
    decode = codec.decode

    def keep_codes(audio_codes, *args, **kwargs):
        codes.append(audio_codes.detach().clone())
        return decode(audio_codes, *args, **kwargs)

    codec.decode = keep_codes
    try:
        with contextlib.ExitStack() as held:
            t1 = time.perf_counter()
            # the embedding stays here: a composing model's passes carry hidden states
            ring = replace(q.ring, options=replace(q.ring.options, embedding_on_node=False))
            split = None if q.model.whole else open_split(ring, model, held, console, q.output.quiet)
            times["nodes"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            if gen.get("do_sample"):
                torch.manual_seed(q.text.seed)
            with torch.no_grad():
                audio = model.generate(**inputs, **gen)
            times["generate"] = time.perf_counter() - t2
    finally:
        del codec.decode  # the class's own method shows through again
    rate = audio_rate(model)
    arr = audio.detach().to(torch.float32).cpu().numpy()
    out = q.output.out or "out.wav"
    written = call_hook("diffuse_write_output", result=arr, path=out, info=OutputInfo(kind="audio", sample_rate=rate))
    if written is None:
        raise DiffuseError(f"no output writer takes audio to {out!r}; use .wav")
    report = {"model": info.path, "mode": "whole" if q.model.whole else "split", "seconds": time.perf_counter() - t0,
              "times": times, "out": written, "sample_rate": rate, "shape": list(arr.shape),
              "codes_shape": list(codes[-1].shape) if codes else None}
    if split is not None:
        st, sp = split.ring.channel_stats, split.splitter
        report.update(calls=st.passes, bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
                      last_hop_bytes_per_step=st.bytes_received / max(1, st.passes),
                      last_hop_max_bytes=st.max_return_bytes,
                      tail_passes=sp.tail_passes, tail_answer_max_bytes=sp.tail_bytes_max,
                      client_head_params=head_params_held(sp),
                      client_layer_params=sp.held_block_parameters(), node_stats=split.node_reports)
        draw = sp.last_draw
        if draw is not None:  # the codes were picked on the last node (diffuse.lm.sampling)
            report["codes_picked"] = {"sample": draw.sample, "draws": draw.draws, "processors": draw.described,
                                      "generator_states_sent": draw.states_sent}
    if q.output.save_tokens:
        with open(q.output.save_tokens, "w") as f:
            json.dump({"input_ids": inputs["input_ids"].tolist(), "new_tokens": codes[-1].tolist() if codes else None}, f)
    console.print(f"[bold green]wrote[/] {written}  (audio, {arr.shape[-1] / rate:.2f} s at {rate} Hz) in "
                  f"{report['seconds']:.1f} s" + (f"; {report['calls']} ring passes" if split else ""))
    if split is not None and report["tail_passes"]:
        picked = report.get("codes_picked")
        how = (f"{'drawn' if picked['sample'] else 'picked'} there after "
               f"{', '.join(name for name, _ in picked['processors']) or 'no processor'}" if picked
               else "picked here from the best candidates")
        console.print(f"  {report['tail_passes']} passes ended in the final norm and heads on the last node, codes "
                      f"{how}; last hop {report['last_hop_bytes_per_step']:.0f} B per step", soft_wrap=True)
    if q.output.report:
        with open(q.output.report, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report
