"""`diffuse check` on transformers folders: the verdict from config.json alone, and refusals before any node starts.

Each verdict is compared with the model's own config.json, read here field by
field (never with numbers Diffuse computed). The splittable models are the
suite's tiny ones (tests/lm_models.py, tests/encdec_models.py); the refused ones
are configs alone, saved by transformers' own config classes with
``architectures`` set as the real checkpoints set them: no weights, since a
verdict must not need any.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import subprocess_env

# where each model's config.json keeps the decoder's depth, and the encoder's where it has one; the two differ in
# every model here, so a verdict that measured the encoder would fail
DECODER_DEPTH = {
    "qwen2": ("num_hidden_layers",),
    "smolvlm": ("text_config", "num_hidden_layers"),
    "qwen2_vl": ("text_config", "num_hidden_layers"),
    "whisper": ("decoder_layers",),
    "musicgen": ("decoder", "num_hidden_layers"),
}
OTHER_DEPTH = {  # a tower or encoder that runs on the client
    "smolvlm": ("vision_config", "num_hidden_layers"),
    "qwen2_vl": ("vision_config", "depth"),
    "whisper": ("encoder_layers",),
    "musicgen": ("text_encoder", "num_layers"),
}
REFUSED = {
    "mamba": "recurrent state: one slice cannot yet hand it to the next",
    "rwkv": "recurrent state: one slice cannot yet hand it to the next",
    "bert": "does not generate",
    "remote_code": "runs a stranger's code on the nodes",
}


def _field(config: dict, path: tuple):
    for key in path:
        config = config[key]
    return config


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _remote_code(folder: str) -> str:
    """A folder as a trust_remote_code checkpoint ships: config.json with an auto_map naming .py files beside it,
    whose code, were it ever imported, would leave a mark."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["StrangerForCausalLM"], "model_type": "stranger", "num_hidden_layers": 2,
                   "hidden_size": 32, "vocab_size": 64,
                   "auto_map": {"AutoConfig": "configuration_stranger.StrangerConfig",
                                "AutoModelForCausalLM": "modeling_stranger.StrangerForCausalLM"}}, f)
    for name in ("configuration_stranger", "modeling_stranger"):
        with open(os.path.join(folder, f"{name}.py"), "w") as f:
            f.write(f"open({os.path.join(folder, 'RAN')!r}, 'w').close()\n")
    return folder


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> dict[str, str]:
    import encdec_models
    import lm_models
    from transformers import BertConfig, MambaConfig, RwkvConfig

    root = tmp_path_factory.mktemp("check-verdicts")
    out = {name: lm_models.build(name, str(root / name)) for name in ("qwen2", "smolvlm", "qwen2_vl")}
    out.update({name: encdec_models.build(name, str(root / name)) for name in ("whisper", "musicgen")})
    tiny = dict(hidden_size=32, num_hidden_layers=3, vocab_size=64)
    for name, config in {
        "mamba": MambaConfig(**tiny, state_size=8, architectures=["MambaForCausalLM"]),
        "rwkv": RwkvConfig(**tiny, architectures=["RwkvForCausalLM"]),
        "bert": BertConfig(**tiny, num_attention_heads=2, intermediate_size=64, architectures=["BertForMaskedLM"]),
    }.items():
        config.save_pretrained(str(root / name))
        out[name] = str(root / name)
    out["remote_code"] = _remote_code(str(root / "remote_code"))
    return out


@pytest.mark.parametrize("name", sorted(DECODER_DEPTH))
def test_the_verdict_says_what_the_models_own_config_says(name, folders, diffuse_home):
    from diffuse.cli.check import check

    folder = folders[name]
    config = _config(folder)
    depth = _field(config, DECODER_DEPTH[name])
    if name in OTHER_DEPTH:
        assert _field(config, OTHER_DEPTH[name]) != depth  # the test can tell the two apart
    r = check(folder)
    assert r["verdict"] == "splittable", r["reason"]
    v = r["config"]
    assert (v["depth"], v["depth_key"]) == (depth, ".".join(DECODER_DEPTH[name]))
    assert v["generates"] and config["architectures"][0] in v["generates_why"]
    assert v["encoder"] is bool(config.get("is_encoder_decoder"))
    if name in ("whisper", "musicgen"):
        assert (v["encoder_depth"], v["encoder_depth_key"]) == (_field(config, OTHER_DEPTH[name]),
                                                              ".".join(OTHER_DEPTH[name]))
    assert bool(v["media"]) is ("vision_config" in config or "audio_config" in config)
    if "image_token_id" in config:
        assert f"image_token_id {config['image_token_id']}" in v["media"]
    assert v["recurrent"] == []
    # the structure built without weights agrees: one decoder stack, as deep as config.json says, sized by that key
    assert [(s["length"], s["config_key"]) for s in r["stacks"]] == [(depth, ".".join(DECODER_DEPTH[name]))]


def test_an_encoders_depth_can_never_pass_for_the_decoders():
    """Whisper-like and MusicGen-like configs whose encoders are deeper than their decoders, with the encoder's
    depth also under the generic names a decoder-only model uses."""
    from diffuse.plan.verdicts import read_config

    whisper = {"architectures": ["WhisperForConditionalGeneration"], "is_encoder_decoder": True,
               "num_hidden_layers": 12, "encoder_layers": 12, "decoder_layers": 4}
    musicgen = {"architectures": ["MusicgenForConditionalGeneration"], "is_encoder_decoder": True, "num_layers": 12,
                "audio_encoder": {"model_type": "encodec", "num_lstm_layers": 2, "num_hidden_layers": 7},
                "text_encoder": {"model_type": "t5", "num_layers": 12, "num_decoder_layers": 12},
                "decoder": {"model_type": "musicgen_decoder", "num_hidden_layers": 24}}
    t5 = {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True, "num_layers": 12,
          "num_decoder_layers": 6}
    vlm = {"architectures": ["XForConditionalGeneration"], "vision_config": {"num_hidden_layers": 27},
           "audio_config": {"encoder_layers": 32}, "text_config": {"num_hidden_layers": 5}}
    found = {name: (read_config(c)["depth"], read_config(c)["depth_key"])
             for name, c in (("whisper", whisper), ("musicgen", musicgen), ("t5", t5), ("vlm", vlm))}
    assert found == {"whisper": (4, "decoder_layers"), "musicgen": (24, "decoder.num_hidden_layers"),
                     "t5": (6, "num_decoder_layers"), "vlm": (5, "text_config.num_hidden_layers")}
    assert read_config(musicgen)["encoder_depth"] == 12 and read_config(t5)["encoder_depth"] == 12
    # an encoder-decoder config that names no decoder depth gets none, not the encoder's
    assert read_config({**whisper, "decoder_layers": None})["depth"] is None


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_check_refuses_from_config_alone_with_the_reason(name, folders, diffuse_home, capsys):
    from diffuse.cli.check import check
    from diffuse.cli.command import main

    folder = folders[name]
    config = _config(folder)
    assert main(["check", folder]) == 2
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("refused: ") and REFUSED[name] in " ".join(out.split())
    r = check(folder)
    assert r["verdict"] == "refused" and r["stacks"] == []
    v = r["config"]
    if name in ("mamba", "rwkv"):  # the recurrent settings it names are the config's own
        assert v["recurrent"] and all(config[f.split()[0]] == int(f.split()[1]) for f in v["recurrent"])
        assert v["generates"]  # it does generate: refused for its state, not for that
    if name == "mamba":
        assert f"state_size {config['state_size']}" in v["recurrent"]
    if name == "bert":
        assert not v["generates"] and v["recurrent"] == [] and v["depth"] == config["num_hidden_layers"]
    assert not os.path.exists(os.path.join(folder, "RAN"))


def test_an_auto_map_beside_config_json_is_refused_too(folders, tmp_path):
    """A tokenizer that ships its own code is remote code as much as a model that does."""
    import shutil

    from diffuse.cli.check import check

    folder = str(tmp_path / "qwen2")
    shutil.copytree(folders["qwen2"], folder)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        tok = json.load(f)
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_stranger.StrangerTokenizer", None]}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tok, f)
    r = check(folder)
    assert r["verdict"] == "refused"
    assert "tokenizer_config.json has an auto_map" in r["reason"] and "StrangerTokenizer" in r["reason"]
    assert "runs a stranger's code on the nodes" in r["reason"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_query_refuses_before_any_node_starts(name, folders, tmp_path):
    """Through ``diffuse query --local-nodes 2``: exit 2, one line, the reason, no traceback, no node started."""
    folder = folders[name]
    env = subprocess_env(str(tmp_path / "home"))
    env["TMPDIR"] = str(tmp_path)  # where local nodes would write their logs
    run = subprocess.run([sys.executable, "-m", "diffuse.cli.command", "query", "--model", folder, "--prompt", "x",
                          "--local-nodes", "2", "--timeout", "20"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()  # a status line first, then the refusal as the last line
    assert lines[-1].startswith(f"error: cannot split {folder}: ") and REFUSED[name] in lines[-1], lines
    assert sum("error" in line for line in lines) == 1 and "starting" not in run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert not [f for f in os.listdir(tmp_path) if f.startswith("diffuse-node")]
    assert not os.path.exists(os.path.join(folder, "RAN"))


def test_run_module_refuses_the_same_way(folders, tmp_path):
    env = subprocess_env(str(tmp_path / "home"))
    env["TMPDIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-m", "diffuse.run", "--model", folders["rwkv"], "--prompt", "x",
                          "--local-nodes", "2", "--timeout", "20"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert REFUSED["rwkv"] in lines[-1] and "rescale_every" in lines[-1] and sum("error" in x for x in lines) == 1
    assert "Traceback" not in run.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith("diffuse-node")]
