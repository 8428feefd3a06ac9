"""The config-phase analyzers, on every family's config.json and on odd models, offline and weightless.

Checkpoint folders here hold only model_index.json and config.json files (what
`diffuse check` reads); each config is the one diffusers itself writes for a
tiny model of the family, built on the meta device.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings

import pytest
import torch

torch.set_num_threads(1)

import diffusers  # noqa: E402

from diffuse.plan.analysis import ModelSubject  # noqa: E402
from diffuse.cli.check import check, print_check  # noqa: E402
from diffuse.errors import RefusedModel  # noqa: E402
from diffuse.plan.contracts import ModelIdentity, ReturnMap, SlicingPlan, even_route  # noqa: E402
from diffuse.plan.planner import config_draft, learn_call  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))

# family: (pipeline, denoiser class, tiny config (the diffusers test suite's), stacks {path: config key},
#          two streams?, output kind). Layer counts differ per stack so that a swapped key would show.
FAMILIES = {
    "wan": ("WanPipeline", "WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32), {"blocks": "num_layers"}, False, "video"),
    "flux": ("FluxPipeline", "FluxTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]),
        {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"}, True, "image"),
    "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel", dict(
        sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4),
        {"transformer_blocks": "num_layers"}, True, "image"),
    "pixart_sigma": ("PixArtSigmaPipeline", "PixArtTransformer2DModel", dict(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6),
        {"transformer_blocks": "num_layers"}, False, "image"),
    "sana": ("SanaPipeline", "SanaTransformer2DModel", dict(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
        sample_size=32), {"transformer_blocks": "num_layers"}, False, "image"),
    "ltx": ("LTXPipeline", "LTXVideoTransformer3DModel", dict(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=2, caption_channels=32), {"transformer_blocks": "num_layers"}, False, "video"),
    "cogvideox": ("CogVideoXPipeline", "CogVideoXTransformer3DModel", dict(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=2, sample_width=2, sample_height=2, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16), {"transformer_blocks": "num_layers"}, True, "video"),
    "cogvideox_rope": ("CogVideoXPipeline", "CogVideoXTransformer3DModel", dict(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=2, sample_width=2, sample_height=2, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16, use_rotary_positional_embeddings=True),
        {"transformer_blocks": "num_layers"}, True, "video"),
    "mochi": ("MochiPipeline", "MochiTransformer3DModel", dict(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=4,
        activation_fn="swiglu", max_sequence_length=16), {"transformer_blocks": "num_layers"}, True, "video"),
    "hunyuan_video": ("HunyuanVideoPipeline", "HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
        num_single_layers=3, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
        {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"}, True, "video"),
    "stable_audio": ("StableAudioPipeline", "StableAudioDiTModel", dict(
        sample_size=4, in_channels=3, num_layers=2, attention_head_dim=4, num_key_value_attention_heads=2,
        out_channels=3, cross_attention_dim=4, time_proj_dim=8, global_states_input_dim=8,
        cross_attention_input_dim=4), {"transformer_blocks": "num_layers"}, False, "audio"),
    "qwenimage": ("QwenImagePipeline", "QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4)),
        {"transformer_blocks": "num_layers"}, True, "image"),
}

SDXL_UNET = dict(
    block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80, cross_attention_dim=64,
    norm_num_groups=1)


def _config_of(cls, kwargs: dict) -> dict:
    """The config.json diffusers writes for ``cls(**kwargs)``: every setting, defaults included."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Oobleck's weight_norm deprecation
        model = cls.from_config(kwargs)
    return {"_class_name": cls.__name__, "_diffusers_version": diffusers.__version__,
            **json.loads(model.to_json_string())}


def write_checkpoint(root, pipeline: str, components: dict) -> str:
    """A pipeline folder with model_index.json and one config.json per component: {name: (library, config)}."""
    os.makedirs(root, exist_ok=True)
    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__}
    for name, (library, config) in components.items():
        index[name] = [library, config["_class_name"]]
        os.makedirs(os.path.join(root, name), exist_ok=True)
        with open(os.path.join(root, name, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    with open(os.path.join(root, "model_index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return str(root)


def family_checkpoint(root, family: str, full_size: bool = False) -> str:
    pipeline, denoiser, kwargs, *_ = FAMILIES[family]
    components = {"transformer": ("diffusers", _config_of(getattr(diffusers, denoiser), {} if full_size else kwargs))}
    if family == "stable_audio":  # the Oobleck VAE's config is where the sample rate lives
        components["vae"] = ("diffusers", _config_of(diffusers.AutoencoderOobleck, dict(
            encoder_hidden_size=6, downsampling_ratios=[1, 2], decoder_channels=3, decoder_input_channels=3,
            audio_channels=2, channel_multiples=[2, 4], sampling_rate=4)))
    return write_checkpoint(root, pipeline, components)


def analyze(path: str) -> dict:
    return config_draft(ModelSubject.from_path(path))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: family_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def drafts(checkpoints):
    """The config phase's draft plan per family, run once."""
    return {f: analyze(path) for f, path in checkpoints.items()}


@pytest.fixture
def oddmodel(monkeypatch):
    """The odd models' package (tests/oddmodel), importable as an installed library would be."""
    monkeypatch.syspath_prepend(TESTS)
    import oddmodel

    return oddmodel


def odd_checkpoint(root, oddmodel, denoiser: str, **kwargs) -> str:
    return write_checkpoint(root, "OddPipeline", {"transformer": ("oddmodel", _config_of(getattr(oddmodel, denoiser), kwargs))})


# --- every family ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_stacks_lengths_and_config_keys_match_the_models_own_config(drafts, family):
    draft = drafts[family]
    _, denoiser, kwargs, keys, *_ = FAMILIES[family]
    found = [(s.path, s.length, s.config_key) for s in draft["stacks"]]
    assert found == [(path, kwargs[key], key) for path, key in keys.items()]
    assert draft["stack_config_keys"] == keys
    for s in draft["stacks"]:
        module, _, name = s.block_class.rpartition(".")
        block = getattr(importlib.import_module(module), name)
        assert issubclass(block, torch.nn.Module) and s.params_per_block > 0


def test_hunyuan_videos_token_refiner_is_not_a_stack(drafts):
    draft = drafts["hunyuan_video"]
    assert [s.path for s in draft["stacks"]] == ["transformer_blocks", "single_transformer_blocks"]
    assert "context_embedder.token_refiner.refiner_blocks" not in draft["other_lists"]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stream_is_read_from_the_blocks_forward(drafts, family):
    draft = drafts[family]
    two = FAMILIES[family][4]
    assert set(draft["two_stream"].values()) == {two}, draft["two_stream_evidence"]
    assert all("returns" in why for why in draft["two_stream_evidence"].values())


@pytest.mark.parametrize("family", FAMILIES)
def test_output_kind_follows_the_pipelines_own_parts(drafts, family):
    draft = drafts[family]
    assert draft["output_kind"] == FAMILIES[family][5], draft["output_evidence"]


def test_frame_rate_comes_from_the_pipelines_default_and_sample_rate_from_the_vae(drafts):
    assert drafts["ltx"]["frame_rate"] == 25  # LTXPipeline.__call__(frame_rate=25)
    assert drafts["wan"]["frame_rate"] is None  # WanPipeline declares none
    assert (drafts["stable_audio"]["sample_rate"], drafts["stable_audio"]["frame_rate"]) == (4, None)
    assert drafts["flux"]["sample_rate"] is None


def test_a_wrapper_block_is_judged_by_what_it_wraps_and_a_list_picked_by_index_is_no_stack(tmp_path):
    """HiDream: both stacks hold the same wrapper class (``return self.block(...)``) around a two-stream or a
    one-stream block; ``caption_projection`` holds blocks the model indexes one by one, never loops over."""
    path = write_checkpoint(tmp_path, "HiDreamImagePipeline", {"transformer": ("diffusers", _config_of(
        diffusers.HiDreamImageTransformer2DModel, dict(
            patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
            num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=4,
            num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1))))})
    draft = analyze(path)
    assert [(s.path, s.length, s.config_key) for s in draft["stacks"]] == [
        ("double_stream_blocks", 1, "num_layers"), ("single_stream_blocks", 2, "num_single_layers")]
    assert draft["two_stream"] == {"double_stream_blocks": True, "single_stream_blocks": False}
    assert "returns self.block(...), and" in draft["two_stream_evidence"]["double_stream_blocks"]
    assert "never loops over" in draft["other_lists"]["caption_projection"]


# --- full-size configs, still weightless ----------------------------------------------------------------------


@pytest.mark.parametrize("family, expected", [
    ("wan", [("blocks", 40, "num_layers")]),
    ("flux", [("transformer_blocks", 19, "num_layers"), ("single_transformer_blocks", 38, "num_single_layers")]),
])
def test_full_size_configs_are_nudged_only_at_settings_equal_to_a_stack_length(tmp_path, monkeypatch, family, expected):
    """A full-size model has many integer settings; the nudger tries those equal to a stack length first and
    stops once every stack has its key: one probe build, then at most one weightless build per such setting."""
    from analyzers import config_nudger

    builds = []
    for name in ("_on_meta", "_on_empty_weights"):
        real = getattr(config_nudger, name)
        monkeypatch.setattr(config_nudger, name, lambda cls, config, real=real: builds.append(cls) or real(cls, config))
    path = family_checkpoint(tmp_path, family, full_size=True)
    draft = analyze(path)
    assert [(s.path, s.length, draft["stack_config_keys"].get(s.path)) for s in draft["stacks"]] == expected
    with open(os.path.join(path, "transformer", "config.json")) as f:
        config = json.load(f)
    ints = [k for k, v in config.items() if not k.startswith("_") and type(v) is int]
    likely = [k for k in ints if config[k] in {length for _, length, _ in expected}]
    assert len(expected) <= len(builds) - 1 <= len(likely) < len(ints) - 3, (len(builds), likely, ints)


# --- refusals -------------------------------------------------------------------------------------------------


def test_sdxl_unet_is_refused_as_a_multi_resolution_unet(tmp_path):
    path = write_checkpoint(tmp_path, "StableDiffusionXLPipeline",
                            {"unet": ("diffusers", _config_of(diffusers.UNet2DConditionModel, SDXL_UNET))})
    with pytest.raises(RefusedModel) as refused:
        analyze(path)
    reason = refused.value.reason
    assert reason.startswith("down_blocks holds 2 blocks of 2 classes (DownBlock2D, CrossAttnDownBlock2D) and 2 "
                             "different widths (32, 64)")
    assert "up_blocks holds" in reason and "multi-resolution U-Net" in reason and "not a chain of equal blocks" in reason


def test_a_denoiser_without_a_stack_is_refused(tmp_path, oddmodel):
    with pytest.raises(RefusedModel, match="no ModuleList of repeated blocks found in NoStackTransformer"):
        analyze(odd_checkpoint(tmp_path, oddmodel, "NoStackTransformer"))


def test_a_recurrent_stack_is_refused(tmp_path, oddmodel):
    with pytest.raises(RefusedModel, match=r"layers holds 3 entries but only 1 distinct block object\(s\): a recurrent"):
        analyze(odd_checkpoint(tmp_path, oddmodel, "RecurrentTransformer", num_repeats=3))


def _with_component(path: str, library: str, cls: str, files: dict[str, str] = {}) -> str:
    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    index["transformer"] = [library, cls]
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(index, f)
    for rel, text in files.items():
        with open(os.path.join(path, rel), "w") as f:
            f.write(text)
    return path


def test_a_component_shipped_as_a_py_file_is_refused_as_remote_code(tmp_path, checkpoints):
    path = family_checkpoint(tmp_path, "wan")
    _with_component(path, "my_transformer", "MyTransformer", {"transformer/my_transformer.py": "class MyTransformer: pass\n"})
    with pytest.raises(RefusedModel, match=r"component 'transformer' is class MyTransformer from "
                                           r"transformer/my_transformer\.py, .* needs trust_remote_code"):
        analyze(path)


def test_an_auto_map_in_a_component_config_is_refused_as_remote_code(tmp_path):
    path = family_checkpoint(tmp_path, "wan")
    with open(os.path.join(path, "transformer", "config.json")) as f:
        cfg = json.load(f)
    cfg["auto_map"] = {"AutoModel": "modeling_custom.CustomTransformer"}
    with open(os.path.join(path, "transformer", "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(RefusedModel, match=r"transformer/config\.json has an auto_map .*CustomTransformer in "
                                           r"modeling_custom\.py.*trust_remote_code"):
        analyze(path)


def test_a_custom_pipeline_file_is_refused_as_remote_code(tmp_path):
    path = family_checkpoint(tmp_path, "wan")
    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    index["_class_name"] = ["pipeline", "MyPipeline"]
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(RefusedModel, match=r"pipeline class MyPipeline from pipeline\.py"):
        analyze(path)


def test_a_library_that_is_not_installed_is_refused_naming_the_package(tmp_path):
    path = _with_component(family_checkpoint(tmp_path, "wan"), "surely_not_installed_dit", "SomeTransformer")
    with pytest.raises(RefusedModel, match=r"needs the Python package 'surely_not_installed_dit' \(class "
                                           r"SomeTransformer\).*pip install surely_not_installed_dit"):
        analyze(path)


# --- an unknown model from an installed library ---------------------------------------------------------------


def test_an_installed_library_is_imported_not_refused_and_its_odd_model_is_found_by_shape(tmp_path, oddmodel):
    draft = analyze(odd_checkpoint(tmp_path, oddmodel, "OddTransformer", num_blocks=3))
    assert draft["component_libraries"] == {"transformer": "oddmodel"}
    [stack] = draft["stacks"]
    assert (stack.path, stack.length, stack.config_key, stack.block_class) == (
        "trunk.layers", 3, "num_blocks", "oddmodel.OddBlock")
    assert draft["two_stream"] == {"trunk.layers": True}
    assert "returns (context, x)" in draft["two_stream_evidence"]["trunk.layers"]
    assert draft["output_kind"] == "image"


@pytest.mark.parametrize("name, verdict, reason", [
    ("odd", "splittable", None),
    ("sdxl", "refused", "a multi-resolution U-Net whose skip connections cross resolutions"),
    ("remote_code", "refused", "from pipeline_remote.py, code shipped with the checkpoint: that needs trust_remote_code"),
    ("no_stack", "refused", "no ModuleList of repeated blocks found in NoStackTransformer"),
    ("recurrent", "refused", "layers holds 4 entries but only 1 distinct block object(s): a recurrent stack"),
])
def test_the_shared_odd_checkpoints_get_their_verdicts(models, name, verdict, reason):
    """The saved checkpoints of tests/families.py (weights and all), as `diffuse check` sees them."""
    result = check(models(name))
    assert result["verdict"] == verdict
    assert (result["reason"] is None) if reason is None else (reason in result["reason"]), result["reason"]


# --- the verdict and the plan ---------------------------------------------------------------------------------


def test_check_gives_the_verdict_and_the_patch_policy(checkpoints, tmp_path):
    flux = check(checkpoints["flux"])
    assert flux["verdict"] == "splittable" and flux["reason"] is None
    assert [(s["path"], s["length"], s["config_key"], s["two_stream"]) for s in flux["stacks"]] == [
        ("transformer_blocks", 2, "num_layers", True), ("single_transformer_blocks", 3, "num_single_layers", True)]
    assert flux["patches"] == "uncut-steps" and flux["output_kind"] == "image"
    assert check(checkpoints["wan"])["patches"] == "patchable"
    refused = check(write_checkpoint(tmp_path, "StableDiffusionXLPipeline",
                                     {"unet": ("diffusers", _config_of(diffusers.UNet2DConditionModel, SDXL_UNET))}))
    assert refused["verdict"] == "refused" and "U-Net" in refused["reason"]


def test_print_check_puts_the_verdict_on_the_first_line(checkpoints, tmp_path, oddmodel):
    from rich.console import Console

    console = Console(record=True, width=200)
    assert print_check(checkpoints["ltx"], console) == 0
    text = console.export_text()
    assert text.splitlines()[0] == "splittable"
    assert "transformer_blocks" in text and "num_layers" in text and "25 fps" in text and "patchable" in text
    console = Console(record=True, width=200)
    assert print_check(odd_checkpoint(tmp_path, oddmodel, "NoStackTransformer"), console) == 2
    assert console.export_text().splitlines()[0] == "refused: no ModuleList of repeated blocks found in NoStackTransformer"


def test_a_first_block_is_mapped_without_reading_its_weights(drafts):
    """Where each tensor a block returns has exactly one input of its shape and dtype, the learner runs the block
    on the meta device. Where two inputs share a shape, it runs the block on the call's values with every weight
    zero, which leaves only the skip connections: each stream comes back exactly as it went in, so the map is the
    same whatever the weights hold (a block whose weights are not loaded, a loaded one, one whose loaded answer
    is as near the other input as its own) and a client never reads, nor fetches, a block's weights to learn it."""
    from torch import nn

    class Block(nn.Module):  # returns (context, hidden), the other way round from how it is called
        def __init__(self, gain=0.01):
            super().__init__()
            self.proj, self.gain = nn.Linear(8, 8), gain

        def forward(self, x, context=None):
            return context + self.gain * self.proj(context), x + self.gain * self.proj(x)

    stack = drafts["hunyuan_video"]["stacks"][0]
    torch.manual_seed(0)
    x, ctx, same = torch.randn(1, 6, 8), torch.randn(1, 3, 8), torch.randn(1, 6, 8)
    want = ReturnMap(single=False, outputs=[1, 0], names=["context", "args[0]"])
    weightless = Block().to("meta")
    assert learn_call(stack, (x,), {"context": ctx}, weightless)[1] == want
    misleading = Block(gain=1.0)  # loaded, it returns zeros: as near (or far) from either input
    with torch.no_grad():
        misleading.proj.weight.copy_(-torch.eye(8))
        misleading.proj.bias.zero_()
        assert not misleading(x, same)[0].any() and not misleading(x, same)[1].any()
    for block in (Block(), weightless, misleading):  # one shape for both: nearness decides, weights zero
        assert learn_call(stack, (x,), {"context": same}, block)[1] == want
    for p in weightless.parameters():
        assert p.is_meta  # nothing was loaded into it


def test_the_plan_survives_a_json_round_trip_with_what_a_first_call_taught(checkpoints, drafts):
    from torch import nn

    class Block(nn.Module):  # hidden states, rotary (cos, sin), a None and a constant, as real blocks are called
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, rotary, mask=None, scale=1.0, context=None):
            return self.proj(x) * scale + rotary[0].sum(), context

    torch.manual_seed(0)
    x, ctx = torch.randn(1, 6, 8), torch.randn(1, 3, 8)
    call_plan, rmap = learn_call(drafts["hunyuan_video"]["stacks"][0], (x, (torch.randn(6, 4), torch.randn(6, 4))),
                                 {"mask": None, "scale": 0.5, "context": ctx}, Block())
    assert call_plan.slot_names == ["args[0]", "args[1][0]", "args[1][1]", "context"]
    assert rmap == ReturnMap(single=False, outputs=[0, 3], names=["args[0]", "context"])
    draft = drafts["hunyuan_video"]
    stacks = tuple(draft["stacks"])
    plan = SlicingPlan(
        model=ModelIdentity(path=checkpoints["hunyuan_video"], denoiser="transformer",
                            denoiser_class="HunyuanVideoTransformer3DModel", content_hash="0" * 16),
        stacks=stacks, output_kind=draft["output_kind"],
        route=even_route(stacks, ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"]),
    ).with_call("transformer_blocks", call_plan, rmap)
    text = plan.to_json()
    again = SlicingPlan.from_json(text)
    assert again == plan  # every field, typed, not only the same text
    assert again.call_plans["transformer_blocks"].tensors[1].shape == [6, 4]
    assert again.stack("single_transformer_blocks").config_key == "num_single_layers"


class _ProbeBlock(torch.nn.Module):
    """A block with one attention head that writes layer ``index`` of the cache it is given (unless ``writes`` is
    off) and hides later positions only when ``causal`` is set: no attribute says which."""

    def __init__(self, index: int, causal: bool, writes: bool = True):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))
        self.norm = torch.nn.LayerNorm(8)
        self.index, self.causal_, self.writes = index, causal, writes

    def forward(self, hidden, cache=None):
        q, k, v = self.q(hidden), self.k(hidden)[:, None], self.v(hidden)[:, None]
        if cache is not None and self.writes:
            k, v = cache.update(k, v, self.index)
        scores = q[:, None] @ k.transpose(-1, -2)
        if self.causal_:
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return self.norm(hidden + (scores.softmax(-1) @ v)[:, 0])


class _ProbeModel(torch.nn.Module):
    def __init__(self, causal: bool, writes: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.tower = torch.nn.ModuleList(_ProbeBlock(i, False) for i in range(2))  # never called by the decoder
        self.layers = torch.nn.ModuleList(_ProbeBlock(i, causal, writes) for i in range(3))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, inputs_embeds, use_cache=False):
        from transformers import DynamicCache

        cache = DynamicCache() if use_cache else None
        for layer in self.layers:
            inputs_embeds = layer(inputs_embeds, cache=cache)
        return inputs_embeds


@pytest.mark.parametrize("causal,writes,verdict", [
    (True, True, None), (False, True, "attend both ways"), (True, False, "do not write one layer")])
def test_the_causal_probe_finds_a_decoder_by_what_its_blocks_do(causal, writes, verdict):
    """A decoder stack is found by behaviour on a weightless build: a change at the last position leaves the
    earlier outputs as they were, and one layer of the cache grows by the positions given. The model lent to
    the probe is put back as it was (every weight on meta, every block its own)."""
    from analyzers.causal_probe import probe_lists

    with torch.device("meta"):
        model = _ProbeModel(causal, writes)
    found = probe_lists(model, ["tower", "layers"])
    assert "never calls" in found["tower"]
    assert found["layers"] is None if verdict is None else verdict in found["layers"]
    assert all(p.device.type == "meta" for p in model.parameters())
    assert len({id(b) for b in model.layers}) == 3 and model.training
