"""A node or client that cannot serve says so clearly and promptly; nobody hangs."""

from __future__ import annotations

import json

import families
from safetensors import safe_open

from conftest import THREADS, node_process, run_client, run_split


def _nodes(model, *shares):
    """Node processes holding these shares (None: what each session asks for), started together."""
    procs = []
    for share in shares:
        args = ["--model", model, "--ephemeral-key", "--threads", str(THREADS)]
        procs.append(node_process(args + (["--blocks", share] if share else [])))
    return [(proc, json.loads(proc.stdout.readline())) for proc in procs]


def _node(model, share):
    return _nodes(model, share)[0]


def _client(model, nodes, tmp_path, home, capsys=None):
    """``python -m diffuse.run`` against these nodes, its client in this process."""
    args = ["--model", model, "--nodes", ",".join(nodes), "--quiet", "--timeout", "20",
            "--out", str(tmp_path / "x.mp4")]
    for k, v in families.call_args("wan").items():
        args += ["--arg", f"{k}={json.dumps(v)}"]
    return run_client(args, home)


def test_node_asked_for_blocks_it_does_not_hold_answers_with_an_error(models, tmp_path, diffuse_home, capsys):
    model = models("wan")
    first, second, free = _nodes(model, "1/2", "2/2", None)
    pinned = [f"{n[1]['address']}#{n[1]['key']}" for n in (first, second, free)]
    try:
        # every node says what it holds, and the client sees that no node holds the second half
        backwards = _client(model, [pinned[0], pinned[0]], tmp_path, diffuse_home, capsys)
        # a node that loads what it is asked for says nothing, so the route is the even split: the node
        # holding blocks[2:4] is asked for blocks[0:2], and says so
        asked = _client(model, [pinned[1], pinned[2]], tmp_path, diffuse_home, capsys)
    finally:
        for p, _ in (first, second, free):
            p.terminate()
            p.wait(10)
    assert backwards.returncode == 2
    said = " ".join(backwards.stderr.split())
    assert "do not chain into whole stacks in route order: blocks[2:4] is held by no node" in said
    assert asked.returncode == 2
    assert "asked for blocks blocks[0:2], but this node holds only blocks[2:4]" in " ".join(asked.stderr.split())
    assert "Traceback" not in backwards.stderr + asked.stderr


def test_wire_version_mismatch_is_refused_at_hello(models, tmp_path, diffuse_home, capsys, monkeypatch):
    model = models("wan")
    proc, ready = _node(model, "all")
    try:
        import diffuse.client.handshake

        monkeypatch.setattr(diffuse.client.handshake, "WIRE_VERSIONS", (99,))  # a client from the future speaks only 99
        run = _client(model, [f"{ready['address']}#{ready['key']}"], tmp_path, diffuse_home, capsys)
    finally:
        proc.terminate()
        proc.wait(10)
    assert run.returncode == 2
    assert "speaks wire versions [1, 2, 3, 4], this client speaks [99]: nothing in common" in run.stderr


def test_pinned_key_mismatch_is_refused(models, tmp_path, diffuse_home, capsys):
    model = models("wan")
    proc, ready = _node(model, "all")
    try:
        run = _client(model, [f"{ready['address']}#{'00' * 32}"], tmp_path, diffuse_home, capsys)
    finally:
        proc.terminate()
        proc.wait(10)
    assert run.returncode == 2
    assert "was pinned: refusing" in run.stderr


def test_each_node_holds_only_its_share_of_block_parameters(models, tmp_path, diffuse_home):
    model = models("flux")
    _, report = run_split(model, families.call_args("flux"), tmp_path, nodes=2, home=diffuse_home)
    # count each node's share straight from the weights file: its contiguous range of every stack
    with safe_open(f"{model}/transformer/diffusion_pytorch_model.safetensors", "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    expected = []
    for stage in range(2):
        total = 0
        for stack in ("transformer_blocks", "single_transformer_blocks"):
            n = len({k.split(".")[1] for k in sizes if k.startswith(stack + ".")})
            lo, hi = (0, (n + 1) // 2) if stage == 0 else ((n + 1) // 2, n)
            for k, shape in sizes.items():
                if k.startswith(stack + ".") and lo <= int(k.split(".")[1]) < hi:
                    numel = 1
                    for d in shape:
                        numel *= d
                    total += numel
        expected.append(total)
    assert report["node_params"] == expected
    assert report["client_block_params"] == 0
