"""A pipeline with two denoiser components (Wan 2.2's high- and low-noise experts) is split whole.

Both experts' stacks go to the nodes, byte-identical against plain diffusers (tests/reference.py, a
subprocess at the same thread count), and the client holds no block of either; ``diffuse check`` lists both.
"""

from __future__ import annotations

import families

from conftest import Reference, run_split


def test_both_experts_are_split_and_the_output_is_byte_identical_to_plain_diffusers(models, tmp_path, diffuse_home):
    import json

    model = models("wan22")
    with open(f"{model}/model_index.json") as f:
        index = json.load(f)
    assert index["transformer"] == index["transformer_2"] and index["boundary_ratio"]  # two experts, one class
    kwargs = families.call_args("wan22")
    reference = Reference(model, kwargs, str(tmp_path / "reference.npy"))  # side by side with the split run
    split, report = run_split(model, kwargs, tmp_path, nodes=2, home=diffuse_home)
    reference = reference.result()
    assert split.shape == reference.shape == families.expected_shape("wan22")
    assert split.tobytes() == reference.tobytes(), f"max abs diff {abs(split - reference).max()}"
    # each expert ran its own steps through the ring (step 1 the first, step 2 the second; cond and uncond each)
    assert {s: v["calls"] for s, v in report["per_stack"].items()} == {"transformer.blocks": 2,
                                                                       "transformer_2.blocks": 2}
    # the client holds no block of either expert; the nodes hold every block of both between them
    assert report["client_block_params"] == 0
    assert sum(report["node_params"]) == sum(_block_params(model, c) for c in ("transformer", "transformer_2"))


def _block_params(model: str, component: str) -> int:
    """Parameters of a component's blocks, counted on its class built weightless from its config.json."""
    import diffusers
    from accelerate import init_empty_weights

    config = diffusers.WanTransformer3DModel.load_config(f"{model}/{component}")
    with init_empty_weights():
        built = diffusers.WanTransformer3DModel.from_config(config)
    return sum(p.numel() for p in built.blocks.parameters())


def test_check_and_plan_list_the_stacks_of_both_experts(models):
    from diffuse.cli.check import check
    from diffuse.plan.planner import analyze, make_plan

    model = models("wan22")
    r = check(model)
    assert r["verdict"] == "splittable"
    assert [(s["path"], s["length"], s["config_key"]) for s in r["stacks"]] == [
        ("transformer.blocks", 4, "transformer.num_layers"), ("transformer_2.blocks", 4, "transformer_2.num_layers")]
    assert "transformer_2: WanTransformer3DModel" in r["denoiser"]
    subject, draft = analyze(model)
    plan = make_plan(subject, draft, ["a", "b"])
    assert [(str(sl)) for stage in plan.route for sl in stage.slices] == [
        "transformer.blocks[0:2]", "transformer_2.blocks[0:2]", "transformer.blocks[2:4]", "transformer_2.blocks[2:4]"]
