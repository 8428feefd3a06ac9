"""GGUF denoisers read as they are: a pipeline folder whose transformer is a .gguf file, split exactly as plain
diffusers runs it whole, each process reading only its own tensors, counted by the file's bytes, refused in one line
where the file and the model disagree.

The GGUF file is written here from the tiny Flux (two stacks; every block's linear layer is 32 or 128 wide, so each
is quantized) with the gguf package's own writer and quantizers: Q8_0 for the attention layers, Q4_0 for the rest of
the blocks' linear layers and the ends', the blocks' biases in F16, everything else F32. The reference is
tests/gguf_reference.py (diffusers' ``from_single_file`` with ``GGUFQuantizationConfig``), run in a fresh process at
the suite's thread count; it imports nothing of Diffuse's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import families
import numpy as np
import pytest

from conftest import TESTS, THREADS, node_process, run_cli, run_client, run_node, subprocess_env

STACKS = ("transformer_blocks", "single_transformer_blocks")  # the tiny Flux's, 3 blocks each
# two nodes, each given a copy of the file in which every tensor but its own slice's is overwritten
SLICES = ({"transformer_blocks": range(0, 2), "single_transformer_blocks": range(0, 2)},
          {"transformer_blocks": range(2, 3), "single_transformer_blocks": range(2, 3)})


def _kind(name: str, shape: tuple, odd: str = ""):
    import gguf

    q = gguf.GGMLQuantizationType
    if name == odd:  # a type gguf-py writes and diffusers' GGUF loader does not read
        return q.MXFP4
    if len(shape) == 2 and shape[-1] % 32 == 0:
        return q.Q8_0 if ".attn." in name else q.Q4_0
    if name.startswith(STACKS) and name.endswith(".bias"):
        return q.F16
    return q.F32


def write_gguf(component_dir: str, path: str, drop: str = "", reshape: str = "", named=None,
               odd: str = "") -> dict[str, str]:
    """The component's safetensors weights written to ``path`` as a GGUF file, each tensor as ``_kind`` says
    (``drop``: a tensor left out; ``reshape``: one written with its last row missing; ``named``: each tensor's name
    in the file, from its name in the model); name -> type."""
    import glob

    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    state = {}
    for f in sorted(glob.glob(os.path.join(component_dir, "*.safetensors"))):
        state.update(load_file(f))
    writer = gguf.GGUFWriter(path, "diffuse-test")
    kinds = {}
    for name, t in state.items():
        if name == drop:
            continue
        a = t.float().numpy()
        a = a[:-1] if name == reshape else a
        kind, called = _kind(name, a.shape, odd), named(name) if named else name
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(called, a)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(called, a.astype(np.float16))
        else:
            q = quantize(a, kind)
            writer.add_tensor(called, q, raw_shape=q.shape, raw_dtype=kind)
        kinds[name] = kind.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kinds


# the tiny Wan's names as Wan's own checkpoints name them (what GGUF files of Wan carry): diffusers' conversion
# (convert_wan_transformer_to_diffusers) undone, for the tensors the tiny Wan has
WAN_ORIGINAL = [("condition_embedder.time_embedder.linear_", "time_embedding.#"),
                ("condition_embedder.text_embedder.linear_", "text_embedding.#"),
                ("condition_embedder.time_proj", "time_projection.1"), ("attn1", "self_attn"), ("attn2", "cross_attn"),
                (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
                ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), ("proj_out", "head.head"),
                (".norm2.", ".norm3."), (".scale_shift_table", ".modulation")]


def wan_original(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    for ours, theirs in WAN_ORIGINAL:
        if theirs.endswith("#") and name.startswith(ours):  # linear_1 -> .0, linear_2 -> .2
            return theirs[:-1] + {"1": "0", "2": "2"}[name[len(ours)]] + name[len(ours) + 1:]
        name = name.replace(ours, theirs)
    return name


def pipeline_with(base: str, dest: str, gguf_file: str) -> str:
    """A pipeline folder: ``base``'s components, its transformer's weights the GGUF file (a copy)."""
    os.makedirs(os.path.join(dest, "transformer"))
    for entry in os.listdir(base):
        if entry != "transformer":
            os.symlink(os.path.join(base, entry), os.path.join(dest, entry))
    shutil.copy(os.path.join(base, "transformer", "config.json"), os.path.join(dest, "transformer"))
    shutil.copy(gguf_file, os.path.join(dest, "transformer", "flux.gguf"))
    return dest


def spoil_all_but(folder: str, keep) -> int:
    """Overwrite (0xFF: NaN in every float type) the bytes of each tensor of the folder's GGUF file for which
    ``keep(name)`` is false; how many were spoilt. A process that reads one of them computes NaNs."""
    import gguf

    path = os.path.join(folder, "transformer", "flux.gguf")
    spoilt = []
    for t in gguf.GGUFReader(path).tensors:
        if not keep(t.name):
            spoilt.append((int(t.data_offset), int(t.n_bytes)))
    with open(path, "r+b") as f:
        for offset, n in spoilt:
            f.seek(offset)
            f.write(b"\xff" * n)
    return len(spoilt)


def _block(name: str, stacks=STACKS):
    for stack in stacks:
        if name.startswith(stack + "."):
            return stack, int(name[len(stack) + 1:].split(".")[0])
    return None


def spoilt_copies(base: str, gguf_file: str, root, slices, stacks=STACKS) -> dict:
    """The pipeline as each node (holding ``slices[n]``) and the client are given it: every tensor of the file but
    theirs spoilt; the client's every block tensor (it learns what a block returns without reading one)."""
    out = {}
    for n, own in enumerate(slices):
        out[f"node{n}"] = pipeline_with(base, str(root / f"node{n}"), gguf_file)

        def theirs(name, own=own):
            where = _block(name, stacks)
            return where is not None and where[1] in own[where[0]]
        assert spoil_all_but(out[f"node{n}"], theirs) > 0
    out["client"] = pipeline_with(base, str(root / "client"), gguf_file)
    assert spoil_all_but(out["client"], lambda name: _block(name, stacks) is None) > 0
    return out


@pytest.fixture(scope="module")
def flux_gguf(models, tmp_path_factory) -> dict:
    """The tiny Flux as a GGUF pipeline, whole, and as each node and the client are given it (spoilt elsewhere)."""
    base = models("flux")
    root = tmp_path_factory.mktemp("gguf")
    kinds = write_gguf(os.path.join(base, "transformer"), str(root / "flux.gguf"))
    out = {"kinds": kinds, "base": base, "file": str(root / "flux.gguf"),
           "whole": pipeline_with(base, str(root / "whole"), str(root / "flux.gguf"))}
    return {**out, **spoilt_copies(base, out["file"], root, SLICES)}


def _args(kwargs: dict) -> list[str]:
    return [a for k, v in kwargs.items() for a in ("--arg", f"{k}={json.dumps(v)}")]


def _ready(proc) -> dict:
    line = proc.stdout.readline()
    assert line, "the node ended before it was ready"
    return json.loads(line)


def reference(folder: str, base: str, kwargs: dict, tmp_path) -> subprocess.Popen:
    """tests/gguf_reference.py on ``folder`` (and on ``base`` as saved, unquantized), started now."""
    return subprocess.Popen([sys.executable, os.path.join(TESTS, "gguf_reference.py"), "--model", folder, "--gguf",
                             os.path.join(folder, "transformer", "flux.gguf"), "--kwargs", json.dumps(kwargs),
                             "--threads", str(THREADS), "--out", str(tmp_path / "reference.npy"), "--plain-model",
                             base, "--plain-out", str(tmp_path / "plain.npy")],
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def split_over(copies: dict, slices, kwargs: dict, tmp_path, home: str) -> dict:
    """The pipeline split over one node per slice, each started on its copy with --blocks, the client on its own;
    its report."""
    nodes = []
    try:
        for n, own in enumerate(slices):
            blocks = ",".join(f"{s}[{r.start}:{r.stop}]" for s, r in own.items())
            nodes.append(node_process(["--model", copies[f"node{n}"], "--blocks", blocks, "--ephemeral-key",
                                       "--threads", str(THREADS), "--log-level", "WARNING"]))
        pinned = ",".join(f"{r['address']}#{r['key']}" for r in map(_ready, nodes))
        report = tmp_path / "report.json"
        split = run_client(["--model", copies["client"], "--nodes", pinned, "--threads", str(THREADS), "--quiet",
                            "--timeout", "120", "--seed", "0", "--save-array", str(tmp_path / "split.npy"),
                            "--report", str(report), *_args(kwargs)], home)
        assert split.returncode == 0, split.stderr[-3000:]
    finally:
        for proc in nodes:
            proc.terminate()
            proc.wait(30)
    with open(report) as f:
        return json.load(f)


def same_as_reference(ref: subprocess.Popen, tmp_path) -> np.ndarray:
    """The split's array, checked byte for byte against the reference's, which differs from the unquantized run."""
    _, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err[-3000:]
    expected, got = np.load(tmp_path / "reference.npy"), np.load(tmp_path / "split.npy")
    assert got.shape == expected.shape and np.isfinite(expected).all()
    assert got.tobytes() == expected.tobytes(), f"max abs diff {np.abs(got - expected).max()}"
    assert np.abs(expected - np.load(tmp_path / "plain.npy")).max() > 0, "nothing was quantized"
    return expected


def test_gguf_split_reads_only_its_own_tensors_and_is_byte_identical_to_plain_diffusers(flux_gguf, tmp_path,
                                                                                          diffuse_home):
    kwargs = families.call_args("flux")
    ref = reference(flux_gguf["whole"], flux_gguf["base"], kwargs, tmp_path)
    report = split_over(flux_gguf, SLICES, kwargs, tmp_path, diffuse_home)
    assert report["client_block_params"] == 0
    # the same run whole here (--whole), from the file as it is
    whole = run_client(["--model", flux_gguf["whole"], "--whole", "--threads", str(THREADS), "--quiet", "--seed", "0",
                        "--save-array", str(tmp_path / "whole.npy"), *_args(kwargs)], diffuse_home)
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = same_as_reference(ref, tmp_path)
    assert np.load(tmp_path / "whole.npy").tobytes() == expected.tobytes()


def test_a_gguf_file_in_wans_own_layout_is_converted_by_diffusers_rule_and_split_exactly(models, tmp_path,
                                                                                     diffuse_home):
    """A GGUF file named as Wan's own checkpoints name their tensors (as published Wan GGUF files are): seen under
    the model's names by diffusers' own conversion, run on views of the file; split over two nodes (each, and the
    client, given the file with every tensor but its own spoilt), byte for byte what diffusers' from_single_file
    (which converts it) runs whole."""
    import torch
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    base = models("wan")
    kinds = write_gguf(os.path.join(base, "transformer"), str(tmp_path / "wan.gguf"), named=wan_original)
    assert {"Q4_0", "Q8_0"} & set(kinds.values()) and {"F16", "F32"} & set(kinds.values())
    back = convert_wan_transformer_to_diffusers({wan_original(n): torch.zeros(1) for n in kinds})
    same = set(map(wan_original, kinds)) & set(kinds)  # (patch_embedding, the blocks' norm1 ... keep their names)
    assert set(back) == set(kinds) and len(same) < len(kinds) // 4, same  # another layout, and diffusers converts it
    folder = pipeline_with(base, str(tmp_path / "wan"), str(tmp_path / "wan.gguf"))
    from diffuse.plan.ggufread import GGUFFile, _component_model

    seen = GGUFFile(os.path.join(folder, "transformer", "flux.gguf")).adopt(_component_model(base + "/transformer"))
    assert seen.converted is not None and sorted(seen.names()) == sorted(kinds)
    # each model tensor traced to the one file tensor it is (what a process reads for it, and nothing else)
    assert seen.converted.sources == {n: {wan_original(n)} for n in kinds}
    kwargs, slices = families.call_args("wan"), ({"blocks": range(0, 2)}, {"blocks": range(2, 4)})
    ref = reference(folder, base, kwargs, tmp_path)
    split_over(spoilt_copies(base, str(tmp_path / "wan.gguf"), tmp_path, slices, ("blocks",)), slices, kwargs,
               tmp_path, diffuse_home)
    same_as_reference(ref, tmp_path)


def test_placement_counts_the_files_own_bytes(flux_gguf, diffuse_home):
    import gguf

    from diffuse.plan.analysis import ModelSubject
    from diffuse.plan.needs import block_costs
    from diffuse.plan.planner import analyze

    subject, draft = analyze(flux_gguf["whole"])
    costs = block_costs(ModelSubject.from_path(flux_gguf["whole"]), draft["stacks"], "float32")
    expected = {}
    for t in gguf.GGUFReader(flux_gguf["file"]).tensors:  # quantized: the file's bytes; F32/F16: float32 held
        where = _block(t.name)
        if where is not None:
            plain = t.tensor_type.name in ("F32", "F16")
            expected[where] = expected.get(where, 0) + (int(t.n_elements) * 4 if plain else int(t.n_bytes))
    assert {(c.stack, c.index): c.weight_bytes for c in costs} == expected
    total = sum(expected.values())
    shown = run_cli(["plan", flux_gguf["whole"], "--memory", "1,1"], diffuse_home)
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = [ln.split() for ln in shown.stdout.splitlines() if "node(s)" in ln and ln.startswith("  ")]
    assert [r[0] for r in rows] == ["none"], rows  # no --quantize mode over a file quantized already
    assert rows[0][2] == f"{total / (1 << 20):.2f}", (rows, total)
    checked = run_cli(["check", flux_gguf["whole"]], diffuse_home)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert f"by --quantize mode: gguf {total / (1 << 30):.3g} GiB" in checked.stdout, checked.stdout


@pytest.mark.timeout(240)
def test_a_gguf_file_that_does_not_match_the_config_is_refused_in_one_line(flux_gguf, tmp_path, diffuse_home,
                                                                            monkeypatch):
    transformer = os.path.join(flux_gguf["base"], "transformer")
    cases = [("drop", "single_transformer_blocks.2.proj_mlp.weight",
              "does not match the model's config: it has no tensor single_transformer_blocks.2.proj_mlp"),
             ("reshape", "transformer_blocks.1.ff.net.2.weight",
              "does not match the model's config: its transformer_blocks.1.ff.net.2.weight has shape"),
             ("odd", "transformer_blocks.2.ff.net.0.proj.weight", "as MXFP4, a type diffusers' GGUF loader does not")]
    for n, (how, name, said) in enumerate(cases):
        bad = str(tmp_path / f"bad{n}.gguf")
        write_gguf(transformer, bad, **{how: name})
        folder = pipeline_with(flux_gguf["base"], str(tmp_path / f"bad{n}"), bad)
        for argv, run in ((["--model", folder, "--prompt", "x", "--local-nodes", "2", "--quiet"], run_client),
                          (["--model", folder, "--blocks", "1/2", "--ephemeral-key"], run_node)):
            done = run(argv, diffuse_home)
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
            assert said in lines[0], lines[0]
    # quantized already: --quantize on top of it is refused, on the client, a node and the planner
    for argv, run in ((["--model", flux_gguf["whole"], "--quantize", "int8", "--prompt", "x", "--quiet"], run_client),
                      (["--model", flux_gguf["whole"], "--quantize", "int8"], run_node),
                      (["plan", flux_gguf["whole"], "--quantize", "int4"], run_cli)):
        done = run(argv, diffuse_home)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert "is a GGUF file, quantized already" in lines[0], lines[0]
    monkeypatch.setitem(sys.modules, "gguf", None)  # as on a machine without it: import gguf fails
    for argv, run in ((["--model", flux_gguf["whole"], "--prompt", "x", "--quiet"], run_client),
                      (["--model", flux_gguf["whole"]], run_node)):
        done = run(argv, diffuse_home)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert "needs the gguf package, which is not installed" in lines[0] and "diffuse[gguf]" in lines[0], lines[0]
