"""A pipeline's VAE on a node, by opt-in (``--decoder ring|NODE``): its decode (and an image-to-image pipeline's
encode) run on the node named, the client holding none of its weights; the picture byte-identical to plain
diffusers' whole run, tiled or not.

Wan's video VAE (its decode a loop over frames with a cache of its causal convolutions) on the ring's last node,
and Flux's image VAE on the first node named, each over two real node processes, through ``diffuse.split``; the
same run through ``diffuse query`` on Wan's nodes; tiled, with tiles small enough that the tiny pictures are cut,
equal to plain diffusers' own tiled decode (``vae.enable_tiling()``) and not to its untiled one; Flux's
image-to-image pipeline, made of the split pipeline's components, encoding its image on the node. The
references are plain diffusers in one subprocess (tests/decode_reference.py), at the same thread count.
"""

from __future__ import annotations

import concurrent.futures

import families
import numpy as np
import pytest

from conftest import THREADS, reference_jobs, run_cli, run_client

# tiles small enough to cut the tiny pictures (Flux's 16x16 picture, Wan's 32x32 frames)
TILES = {"flux": {"tile_sample_min_size": 8, "tile_latent_min_size": 8, "tile_overlap_factor": 0.25},
         "wan": {"tile_sample_min_height": 16, "tile_sample_min_width": 16, "tile_sample_stride_height": 8,
                 "tile_sample_stride_width": 8}}
WHERE = {"flux": "1", "wan": "ring"}  # the node named: Flux's first, Wan's the ring's last
SERVED = {"prompt": "a red cat", "height": 16, "width": 16, "num_inference_steps": 2}  # a service's request, seed 3
I2I = {"prompt": "a squirrel", "strength": 0.6, "num_inference_steps": 2, "height": 16, "width": 16,
       "max_sequence_length": 48}


@pytest.fixture(scope="module")
def nodes(models):
    """Each family's nodes, started with --decoder ring: Wan's loading what each session asks (its bfloat16 run
    too); Flux's first with --blocks all (the VAE is no part of them: it loads it when named), its second
    without, a third with less memory than the VAE's weights, a fourth with a little more."""
    from diffuse.local.nodes import start_local_nodes

    started = {"wan": start_local_nodes(models("wan"), 2, THREADS, extra=["--decoder", "ring"], fixed=False),
               "flux": start_local_nodes(models("flux"), 4, THREADS, extra=["--decoder", "ring"], fixed=False,
                                         each=[["--blocks", "all"], [], ["--max-memory", "0.00001"],
                                               ["--max-memory", "0.00002"]])}
    yield started
    for group in started.values():
        group.stop()


@pytest.fixture(scope="module")
def runs(models, nodes, tmp_path_factory):
    """{case: (the reference's array, the split's array)} and {family: what the split saw}; the references run in
    one subprocess while the split side runs here."""
    root = tmp_path_factory.mktemp("decoders")
    image = root / "image.npy"
    np.save(image, np.linspace(0, 1, 16 * 16 * 3, dtype=np.float32).reshape(1, 16, 16, 3))
    jobs = {}
    for family in ("flux", "wan"):
        args = {"model": models(family), "kwargs": families.call_args(family), "seed": 0}
        jobs[family] = {**args, "out": str(root / f"{family}.npy")}
        jobs[f"{family}-tiled"] = {**args, "out": str(root / f"{family}-tiled.npy"), "tiling": True,
                                   "vae": TILES[family]}
    jobs["wan-bf16"] = {"model": models("wan"), "kwargs": families.call_args("wan"), "seed": 0, "dtype": "bfloat16",
                        "out": str(root / "wan-bf16.npy")}
    jobs["service"] = {"model": models("flux"), "kwargs": SERVED, "seed": 3, "out": str(root / "service.npy")}
    video = root / "video.npy"  # 5 frames of 16x16, -1 to 1, as a video pipeline hands its VAE
    np.save(video, np.linspace(-1, 1, 3 * 5 * 16 * 16, dtype=np.float32).reshape(1, 3, 5, 16, 16))
    jobs["wan-encode"] = {"model": models("wan"), "encode": str(video), "seed": 0, "out": str(root / "encoded.npy")}
    jobs["flux-i2i"] = {"model": models("flux"), "kwargs": I2I, "seed": 0, "out": str(root / "i2i.npy"),
                        "pipeline": "FluxImg2ImgPipeline", "image": str(image)}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        references = pool.submit(reference_jobs, "decode_reference.py", list(jobs.values()), str(root))
        split, seen = {}, {}
        for family in ("flux", "wan"):
            arrays, seen[family] = _split_side(models(family), nodes[family][:2], family,
                                               np.load(video if family == "wan" else image))
            split.update(arrays)
        results = references.result()
    out = {}
    for case, result in zip(jobs, results):
        assert "error" not in result, f"{case}: {result.get('error')}"
        out[case] = (np.load(result["array"]), split.get(case))
    return out, seen


def _split_side(model: str, nodes, family: str, image):
    """The family's runs through ``diffuse.split`` over ``nodes``, untiled and tiled (and Flux's image-to-image of
    ``image``, Wan's VAE encoding it, a video), and what the split saw: the node holding the VAE, the passes, the
    client's VAE tensors."""
    import diffusers
    import torch

    import diffuse

    pipe = diffuse.from_pretrained(model, decoder="ring")
    listed = [f"{n.address}#{n.key}" for n in nodes]
    arrays, seen = {}, {}

    def run(case, call=None, **kwargs):
        with diffuse.split(pipe, nodes=listed, timeout=60, decoder=WHERE[family]) as ring, torch.no_grad():
            out = (call or pipe)(**kwargs, generator=torch.Generator("cpu").manual_seed(0), output_type="np")
            arrays[case] = np.asarray(out[0])
            seen[case] = {"holder": [s.address for s in ring.plan.route for sl in s.slices
                                     if sl.stack == "vae" and not sl.empty],
                          "passes": dict(ring.decoder_calls.passes)}

    run(family, **families.call_args(family))
    pipe.vae.enable_tiling()
    for key, value in TILES[family].items():
        setattr(pipe.vae, key, value)
    run(f"{family}-tiled", **families.call_args(family))
    pipe.vae.disable_tiling()
    if family == "flux":  # an image-to-image pipeline of the same components: its VAE encodes the image on the node
        run("flux-i2i", diffusers.FluxImg2ImgPipeline(**pipe.components), image=image, **I2I)
    else:  # its video VAE encoding frames, drawn from here with the generator; in bfloat16 on the same nodes
        with diffuse.split(pipe, nodes=listed, timeout=60, decoder=WHERE[family]), torch.no_grad():
            dist = pipe.vae.encode(torch.from_numpy(image)).latent_dist
            arrays["wan-encode"] = dist.sample(generator=torch.Generator("cpu").manual_seed(0)).numpy()
        pipe = diffuse.from_pretrained(model, dtype="bfloat16", decoder="ring")  # the VAE's float32 rule, its own
        run("wan-bf16", **families.call_args(family))
    seen["client"] = {p.device.type for p in pipe.vae.parameters()} | {b.device.type for b in pipe.vae.buffers()}
    seen["nodes"] = [n.address for n in nodes]
    return arrays, seen


@pytest.mark.parametrize("case", ["wan", "flux", "wan-tiled", "flux-tiled", "flux-i2i", "wan-encode", "wan-bf16"])
def test_the_picture_is_byte_identical_to_plain_diffusers_with_the_vae_on_a_node(case, runs):
    """Untiled, tiled (against diffusers' own tiled decode, with the same tile sizes), an image-to-image run, Wan's
    video VAE encoding frames (a draw from the latent distribution it answers), and Wan loaded in bfloat16 (its
    transformer keeps norms named as the VAE's in float32: the VAE must not)."""
    reference, split = runs[0][case]
    assert reference.shape == split.shape and reference.dtype == split.dtype == np.float32
    assert split.tobytes() == reference.tobytes(), f"{case}: max abs diff {np.abs(split - reference).max()}"


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_tiles_cut_the_picture(family, runs):
    """The tiled reference differs from the untiled one: the tiles were small enough to change the decode."""
    assert runs[0][f"{family}-tiled"][0].tobytes() != runs[0][family][0].tobytes()


def test_only_the_node_named_holds_the_vae_and_the_client_reads_none_of_it(runs):
    _, seen = runs
    assert seen["wan"]["wan"]["holder"] == [seen["wan"]["nodes"][-1]]  # ring: the route's last
    assert seen["flux"]["flux"]["holder"] == [seen["flux"]["nodes"][0]]  # named: the first
    for family in ("wan", "flux"):
        assert seen[family][family]["passes"] == {"decode": 1, "encode": 0}
        assert seen[family]["client"] == {"meta"}  # the client's VAE: weightless, never read
    assert seen["flux"]["flux-i2i"]["passes"] == {"decode": 1, "encode": 1}


def test_diffuse_query_with_the_vae_on_a_named_node_is_byte_identical(models, nodes, runs, tmp_path, diffuse_home):
    """Through the command, on Wan's two nodes, the VAE on the first (named by its address)."""
    import json

    wan = nodes["wan"]
    kwargs = families.call_args("wan")
    argv = ["--model", models("wan"), "--seed", "0", "--threads", str(THREADS), "--quiet", "--timeout", "60",
            "--nodes", ",".join(f"{n.address}#{n.key}" for n in wan), "--decoder", wan[0].address,
            "--save-array", str(tmp_path / "split.npy"), "--report", str(tmp_path / "report.json"),
            "--out", str(tmp_path / "out.mp4")]
    for k, v in kwargs.items():
        argv += ["--arg", f"{k}={json.dumps(v)}"]
    run = run_client(argv, diffuse_home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert np.load(tmp_path / "split.npy").tobytes() == runs[0]["wan"][0].tobytes()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["per_stack"]["vae"]["calls"] == 1 and report["client_block_params"] == 0


def test_the_service_decodes_on_the_node_named_and_answers_as_plain_diffusers(models, nodes, runs, diffuse_home):
    """``diffuse serve --decoder 2`` over Flux's two nodes: its warm copy of the pipeline holds no VAE weights, a
    request's session opens with the VAE on the second node, and the picture is the one plain diffusers makes."""
    from conftest import hello_report
    from diffuse.serve.command import ServeOptions, Service
    from diffuse.serve.engines import Cancel
    from diffuse.serve.pipeline import Ask

    model, flux = models("flux"), nodes["flux"][:2]
    service = Service.start([model], [",".join(f"{n.address}#{n.key}" for n in flux)],
                            ServeOptions(threads=THREADS, decoder="2"), lambda _: None)
    try:
        (engine,) = service.engines.values()
        picture = engine.run(Ask("a red cat", height=16, width=16, steps=2, seed=3), Cancel())
        warm = engine.pool.take(Cancel())  # the copy the request used, back in the pool
        assert {p.device.type for p in warm.vae.parameters()} == {"meta"}
        held = {(stack, i) for stack, i, _ in hello_report(flux[1].address).holds}  # no earlier test named it
    finally:
        service.stop()
    assert picture.array.tobytes() == runs[0]["service"][0].tobytes()
    assert ("vae", 0) in held


def test_a_node_short_of_room_for_an_untiled_decode_decodes_in_tiles_as_plain_diffusers_does(models, nodes, runs):
    """--decoder-tiling auto: Flux's fourth node holds the VAE's weights with 3 KiB to spare, less than the
    decode's largest activation thrice: it decodes in tiles, of the sizes the client's VAE names, equal to plain
    diffusers' own tiled decode with them."""
    import torch

    import diffuse

    flux = nodes["flux"]
    pipe = diffuse.from_pretrained(models("flux"), decoder="ring")
    for key, value in TILES["flux"].items():
        setattr(pipe.vae, key, value)  # the sizes only: tiling itself is off, as the pipeline loaded it
    said = []
    with diffuse.split(pipe, nodes=[f"{n.address}#{n.key}" for n in (flux[1], flux[3])], timeout=60,
                       decoder="2") as ring, torch.no_grad():
        ring.ring.say = said.append
        ring.decoder_calls.say = said.append
        out = pipe(**families.call_args("flux"), generator=torch.Generator("cpu").manual_seed(0), output_type="np")
        tiled = ring.decoder_calls.tiled
    assert tiled == 1 and any("the VAE decodes in tiles on its node" in line for line in said), said
    assert np.asarray(out[0]).tobytes() == runs[0]["flux-tiled"][0].tobytes()
    assert not pipe.vae.use_tiling  # the client's VAE as it was


@pytest.mark.parametrize("where, said", [
    ("3", "--decoder 3: there is no node 3 (2 local nodes"),
    ("tcp://127.0.0.1:9", "--decoder tcp://127.0.0.1:9: local nodes are named by their place (1 to 2)"),
])
def test_a_node_that_is_not_there_is_refused_in_one_line_before_any_node_starts(where, said, models, diffuse_home):
    """Through the command, one line and exit 2; through the API, by ``split`` itself, before its ``with`` block
    is entered, which is where local nodes start."""
    import re

    import diffuse
    from diffuse.errors import DiffuseError

    run = run_client(["--model", models("flux"), "--local-nodes", "2", "--decoder", where, "--quiet"], diffuse_home)
    assert run.returncode == 2 and said in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    pipe = diffuse.from_pretrained(models("flux"), decoder="ring")
    with pytest.raises(DiffuseError, match=re.escape(said)):
        diffuse.split(pipe, local_nodes=2, decoder=where)


def test_a_node_whose_memory_cannot_hold_the_vae_is_refused_in_one_line(models, nodes, diffuse_home):
    """Flux's third node may take 10 KiB (--max-memory), less than the VAE's weights (18 KiB): the other stacks go
    to the first node, the VAE named to the third is refused at the route, before any session opens."""
    flux = nodes["flux"]
    listed = ",".join(f"{n.address}#{n.key}" for n in (flux[0], flux[2]))
    run = run_client(["--model", models("flux"), "--nodes", listed, "--decoder", "2", "--prompt", "a squirrel",
                      "--steps", "1", "--quiet",
                      "--timeout", "30", "--height", "16", "--width", "16"], diffuse_home)
    assert run.returncode == 2, run.stderr
    line = run.stderr.strip().splitlines()
    assert len(line) == 1 and f"--decoder: node {flux[2].address} has 0.000 GiB available" in line[0], run.stderr
    assert "name a node with more memory, or --decoder client" in line[0]


def test_client_and_nodes_that_disagree_on_the_vae_are_refused_saying_which_flag(models, nodes, diffuse_home):
    """Nodes started with --decoder ring serve the pipeline with its VAE (their content hash covers it): a client
    without --decoder is told what to match, as one with it is by nodes without."""
    first = nodes["flux"][0]
    run = run_client(["--model", models("flux"), "--nodes", f"{first.address}#{first.key}", "--prompt", "a",
                      "--steps", "1",
                      "--quiet", "--timeout", "30", "--height", "16", "--width", "16"], diffuse_home)
    assert run.returncode == 2 and "the same --encoders and --decoder" in run.stderr, run.stderr


def test_diffuse_plan_says_where_the_vae_runs(models):
    """The parts: the VAE on the nodes, all of it, on the node named; without --decoder, on the client."""
    run = run_cli(["plan", models("flux"), "--memory", "1,1", "--decoder", "2"])
    assert run.returncode == 0, run.stderr[-2000:]
    vae = next(line.split() for line in run.stdout.splitlines() if line.strip().startswith("vae "))
    assert vae[1:4] == ["AutoencoderKL", "nodes", "nodes"] and vae[-1] == "(vae)", vae
    assert "the VAE (vae) decodes on node 2 (--decoder), beside its share; that node sees the result" in run.stdout
    plain = run_cli(["plan", models("flux"), "--memory", "1,1"])
    assert next(line.split() for line in plain.stdout.splitlines() if line.strip().startswith("vae "))[2] == "client"


def test_the_largest_activation_of_a_decode_is_read_off_the_weightless_vae(models):
    """What --decoder-tiling auto weighs against the node's room: at least the decoded picture itself, and more
    for a larger latent, read without computing anything."""
    import torch

    import diffuse
    from diffuse.client.decoders import decode_peak
    from diffuse.plan.components import runtime_settings

    vae = diffuse.from_pretrained(models("flux"), decoder="ring").vae
    channels = vae.config.latent_channels
    small = decode_peak(vae, runtime_settings(vae), (torch.zeros(1, channels, 8, 8),), {})
    large = decode_peak(vae, runtime_settings(vae), (torch.zeros(1, channels, 32, 32),), {})
    assert small >= 3 * 8 * 8 * 4 and large == 16 * small


def test_a_client_of_a_hub_model_with_its_vae_on_a_node_fetches_none_of_its_weights(tmp_path):
    """``--decoder`` with a Hub id: the client fetches the VAE's config and its file's header, not a byte of its
    tensors (a node fetches them as it loads the VAE); the transformer's ends still come."""
    import subprocess
    import sys

    from hubtest import REPO, hub_env, ranges_of, tensor_spans
    from diffuse.bench.hubserver import HubServer
    from diffuse.plan.shipped import shipped_models

    vae, transformer = "vae/diffusion_pytorch_model.safetensors", "transformer/diffusion_pytorch_model.safetensors"
    with HubServer() as hub:
        hub.source = shipped_models()["tiny-wan-shapes"]
        hub.publish(REPO, hub.source)
        code = ("import diffuse; pipe = diffuse.from_pretrained(" f"{REPO!r}, decoder='ring'); "
                "assert {p.device.type for p in pipe.vae.parameters()} == {'meta'}")
        done = subprocess.run([sys.executable, "-c", code], env=hub_env(hub, "client-decoder", tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    _, spans = tensor_spans(f"{hub.source}/{vae}")
    fetched = ranges_of(hub, "client-decoder", vae)
    assert spans and not any(a < e and s < b for a, b in fetched for s, e in spans.values())  # no byte of a tensor
    assert fetched  # its header: the client reads the VAE's layout, as every part's
    assert ranges_of(hub, "client-decoder", transformer)  # the denoiser's ends


def test_the_client_memory_counts_no_vae_weights_where_a_node_holds_the_vae(models):
    """``--client-memory`` weighs what the client keeps: with the VAE on a node, none of it; a budget between the
    two is met only so (the budget never moves the VAE itself: that node sees the result)."""
    from diffuse.errors import DiffuseError
    from diffuse.plan.budget import client_weights, fit_encoders
    from diffuse.plan.parts import component_bytes
    from diffuse.plan.planner import analyze

    flux = models("flux")
    with_vae, without = (client_weights(*analyze(flux, decoders=d), "float32") for d in (False, True))
    assert with_vae - without == component_bytes(f"{flux}/vae", 4) > 0
    assert fit_encoders(flux, without, False, None, decoders=True) == (False, without)
    with pytest.raises(DiffuseError, match="--client-memory .* the smallest client needs"):
        fit_encoders(flux, without, False, None)


def test_a_pass_into_the_vae_asks_only_decode_or_encode_and_sets_only_its_own_settings(models):
    """What a node runs for a VAE's pass (``Coder``): the VAE's own method, with its own runtime settings as the
    client sends them; another method, another attribute, another type or a number no setting takes is refused."""
    import diffusers
    import torch

    from diffuse.errors import DiffuseError
    from diffuse.plan.components import coders

    vae = diffusers.AutoencoderKL.from_pretrained(f"{models('flux')}/vae")
    coder = coders(vae)[0]
    z = torch.randn(1, vae.config.latent_channels, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = coder("decode", {"use_tiling": False}, z)
        assert torch.equal(whole, vae.decode(z, return_dict=False)[0])
        tiled = coder("decode", {"tile_sample_min_size": 2, "tile_latent_min_size": 2, "use_tiling": True}, z)
        assert vae.use_tiling and vae.tile_latent_min_size == 2 and not torch.equal(tiled, whole)  # set as sent
        for bad in ({"training": True}, {"decoder": 1}, {"use_tiling": 1}, {"tile_overlap_factor": float("nan")},
                    {"tile_sample_min_size": -1}):
            with pytest.raises(DiffuseError, match="is not one of its settings"):
                coder("decode", bad, z)
        with pytest.raises(DiffuseError, match="only decode or encode"):
            coder("forward", {}, z)


def test_outside_the_split_the_weightless_vae_refuses_to_decode(models, nodes):
    """After ``with diffuse.split(...)`` the pipeline's VAE has no weights here: decoding says so, naming the way
    out, rather than computing on nothing."""
    import torch

    import diffuse
    from diffuse.errors import DiffuseError

    pipe = diffuse.from_pretrained(models("flux"), decoder="ring")
    flux = nodes["flux"][:2]
    z = torch.zeros(1, pipe.vae.config.latent_channels, 4, 4)
    with diffuse.split(pipe, nodes=[f"{n.address}#{n.key}" for n in flux], timeout=60), torch.no_grad():
        assert pipe.vae.decode(z, return_dict=False)[0].shape == (1, 3, 4, 4)
    with pytest.raises(DiffuseError, match="held by nodes: call it inside `with diffuse.split"), torch.no_grad():
        pipe.vae.decode(z)


def test_the_plan_as_json_puts_the_vae_on_the_node_named(models):
    """``diffuse plan --nodes N --decoder ...``: the VAE's slice wholly on that node, empty elsewhere."""
    import json

    for where, holder in (("2", 1), ("ring", 2)):
        run = run_cli(["plan", models("flux"), "--nodes", "3", "--decoder", where])
        assert run.returncode == 0, run.stderr[-2000:]
        slices = [[(s["start"], s["stop"]) for s in st["slices"] if s["stack"] == "vae"]
                  for st in json.loads(run.stdout)["route"]]
        assert slices == [[(0, 1)] if i == holder else [(0, 0)] if i < holder else [(1, 1)] for i in range(3)]


def test_a_pipeline_loaded_without_its_vae_is_refused_a_split_that_decodes_here(models):
    import diffuse
    from diffuse.errors import DiffuseError

    pipe = diffuse.from_pretrained(models("flux"), decoder="ring")
    with pytest.raises(DiffuseError, match="loaded without its VAE's weights"):
        diffuse.split(pipe, local_nodes=2, decoder="client")
