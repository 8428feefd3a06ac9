"""A transformers model's verdict from its config.json alone, before anything is built.

Five questions, each answered from the config's own fields, with the field
that answered it:

- how deep is the decoder stack: the known depth names tried in order (the
  decoder's own names first), at the top level, then in the decoder's section
  (``text_config``, ``decoder``, ...), then in any other section that declares
  a depth. Sections that hold an encoder or a media tower (``text_encoder``,
  ``audio_encoder``, ``vision_config``, ``audio_config``) are never measured,
  and in an encoder-decoder config the generic names (``num_hidden_layers``,
  ``num_layers``) are not trusted at the top level, where they may name the
  encoder's depth: Whisper's 12 encoder layers or a T5 text encoder's 12
  cannot pass for a decoder's 24.
- does it generate: the architecture name ends in a generating head
  (``ForCausalLM``, ``ForConditionalGeneration``, ``LMHeadModel``, ...).
- does it read media: ``vision_config``, ``audio_config``, placeholder token ids.
- does it read an encoder: ``is_encoder_decoder``.
- does it carry recurrent state: ``state_size``, ``conv_kernel`` and friends
  (integers: a list of convolution widths is a feature extractor's).

``refusal_of`` names what cannot be split: recurrent state (Mamba, RWKV: a
running state one slice cannot yet hand to the next) and models that do not
generate (an encoder alone, such as BERT). The ``config_reader`` analyzer
refuses with it before any model is built; ``diffuse check`` prints
``describe``'s lines. Nothing here imports torch.
"""

from __future__ import annotations

import re

DEPTH_NAMES = ("decoder_layers", "num_decoder_layers", "num_hidden_layers", "n_layer", "num_layers", "n_layers")
DECODER_DEPTH_NAMES = DEPTH_NAMES[:2]  # names only a decoder's depth goes by
DECODER_SECTIONS = ("text_config", "decoder", "language_config", "llm_config", "text_model", "language_model")
_ENCODER_OR_MEDIA = re.compile(r"encoder|vision|visual|audio|speech|image|video|perceiver|projector")
GENERATING_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel", "ForSpeechToText", "ForTextToText",
                       "ForTextToSpeech", "ForSpeechToSpeech", "Text2Text", "ForCausalImageModeling", "ForGeneration",
                       "EncoderDecoderModel")
RECURRENT_KEYS = ("state_size", "ssm_state_size", "mamba_d_state", "conv_kernel", "mamba_d_conv", "conv_L_cache",
                  "linear_conv_kernel_dim", "time_step_rank", "rescale_every", "lru_width")
MEDIA_SECTIONS = ("vision_config", "audio_config", "speech_config")
_PLACEHOLDER = re.compile(r"^(image|video|audio|speech|vision_start|vision_end)_token_(id|index)$")

RECURRENT_REASON = "recurrent state: one slice cannot yet hand it to the next"


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _sections(config: dict) -> list[tuple[str, dict]]:
    """(name, section) of the nested configurations a decoder may live in, the decoder's known names first;
    encoder and media sections left out."""
    subs = [(k, v) for k, v in config.items()
            if isinstance(v, dict) and (k.endswith("_config") or "model_type" in v or k in DECODER_SECTIONS)]
    known = [(k, v) for k in DECODER_SECTIONS for kk, v in subs if kk == k]
    rest = [(k, v) for k, v in subs if k not in DECODER_SECTIONS and not _ENCODER_OR_MEDIA.search(k)]
    return known + rest


def decoder_depth(config: dict) -> tuple[int | None, str | None]:
    """(depth of the decoder stack, the dotted config key it was read from), or (None, None)."""
    top_names = DECODER_DEPTH_NAMES if config.get("is_encoder_decoder") else DEPTH_NAMES
    for name in top_names:
        if _int(config.get(name)):
            return config[name], name
    for section, sub in _sections(config):
        names = DECODER_DEPTH_NAMES if sub.get("is_encoder_decoder") else DEPTH_NAMES
        for name in names:
            if _int(sub.get(name)):
                return sub[name], f"{section}.{name}"
    return None, None


def encoder_depth(config: dict) -> tuple[int | None, str | None]:
    """(depth of the encoder a decoder reads, its key), for the record: it runs on the client."""
    if _int(config.get("encoder_layers")):
        return config["encoder_layers"], "encoder_layers"
    if _int(config.get("num_decoder_layers")) and _int(config.get("num_layers")):
        return config["num_layers"], "num_layers"
    sections = sorted((k for k, v in config.items() if isinstance(v, dict) and "encoder" in k),
                      key=lambda k: k not in ("encoder", "text_encoder"))  # a codec ("audio_encoder") last
    for k in sections:
        for name in ("encoder_layers", "num_layers", "num_hidden_layers", "n_layer", "n_layers"):
            if _int(config[k].get(name)):
                return config[k][name], f"{k}.{name}"
    return None, None


def read_config(config: dict) -> dict:
    """The verdict's facts from a transformers config.json (a plain dict), each with the fields it rests on."""
    arch = str((config.get("architectures") or [""])[0])
    depth, depth_key = decoder_depth(config)
    suffix = next((s for s in GENERATING_SUFFIXES if arch.endswith(s)), None)
    media = [k for k in MEDIA_SECTIONS if isinstance(config.get(k), dict)]
    media += [f"{k} {v}" for k, v in config.items() if _PLACEHOLDER.match(k) and _int(v)]
    encoder = config.get("is_encoder_decoder") is True
    enc_depth, enc_key = encoder_depth(config) if encoder else (None, None)
    # recurrent state is the decoder's: looked for at the top level and in the section its depth came from
    where = [("", config)]
    if depth_key and "." in depth_key:
        where.append((depth_key.split(".")[0] + ".", config[depth_key.split(".")[0]]))
    recurrent = [f"{prefix}{k} {sub[k]}" for prefix, sub in where for k in RECURRENT_KEYS if _int(sub.get(k))]
    return {
        "architecture": arch,
        "depth": depth, "depth_key": depth_key,
        "generates": suffix is not None,
        "generates_why": (f"{arch} ends in {suffix}" if suffix else
                          f"{arch} ends in none of {', '.join(GENERATING_SUFFIXES[:3])}, ..."),
        "media": media,
        "encoder": encoder, "encoder_depth": enc_depth, "encoder_depth_key": enc_key,
        "recurrent": recurrent,
    }


def refusal_of(verdict: dict) -> str | None:
    """The reason a model with these facts cannot be split, or None."""
    if verdict["recurrent"]:
        return f"{RECURRENT_REASON} ({verdict['architecture']}: config.json declares {', '.join(verdict['recurrent'])})"
    if not verdict["generates"]:
        return (f"does not generate: {verdict['generates_why']} (an encoder alone: nothing to hand from slice to "
                "slice token by token)")
    return None


def describe(verdict: dict) -> list[str]:
    """The facts as lines of text, one per question."""
    d = verdict
    stack = "decoder depth" if d["generates"] else "stack depth"
    depth = (f"{stack} {d['depth']} ({d['depth_key']})" if d["depth"] is not None else
             f"{stack}: none of {', '.join(DEPTH_NAMES)} declared (measured from the model's structure)")
    if d["encoder"]:
        enc = (f"the encoder's {d['encoder_depth']} ({d['encoder_depth_key']}) run on the client"
               if d["encoder_depth"] is not None else "the encoder runs on the client")
        encoder = f"reads an encoder: yes (is_encoder_decoder); {enc}"
    else:
        encoder = "reads an encoder: no (is_encoder_decoder not set)"
    return [
        depth,
        f"generates: {'yes' if d['generates'] else 'no'} ({d['generates_why']})",
        f"reads media: yes ({', '.join(d['media'])})" if d["media"] else
        "reads media: no (no vision_config, audio_config or placeholder token id)",
        encoder,
        f"recurrent state: yes ({', '.join(d['recurrent'])})" if d["recurrent"] else
        "recurrent state: none (no state_size, conv_kernel or the like)",
    ]

