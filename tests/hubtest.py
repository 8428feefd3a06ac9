"""The loopback Hub the fetching tests share (``diffuse.bench.hubserver``), serving the shipped model as
``org/tiny-wan`` (gated too, as ``org/gated``), and what they read from its access log: which byte ranges of
which file each process was sent. Each test module that imports the ``hub`` fixture starts a server of its own.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from conftest import subprocess_env

REPO = "org/tiny-wan"
DENOISER = "transformer/diffusion_pytorch_model.safetensors"
TOKEN = "hf_testtoken"  # what org/gated asks for
TOKENIZER = "tokenizer/tokenizer.json"  # published 2 MB large: only a client fetches it


def tensor_spans(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """A safetensors file's header length and each tensor's byte range in the file, read here from its bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    return n, {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in meta.items()
               if k != "__metadata__"}


def block_bytes(spans: dict, blocks) -> int:
    return sum(b - a for k, (a, b) in spans.items() if k.startswith("blocks.") and int(k.split(".")[1]) in blocks)


def ranges_of(hub, who: str, file: str) -> list[tuple[int, int]]:
    """The byte ranges ``who`` was sent of ``file`` (a GET without a range: all of it)."""
    out = []
    for e in hub.log:
        if e["who"] == who and e["file"] == file and e["method"] == "GET" and e["sent"]:
            start = e["range"][0] if e.get("range") else 0
            out.append((start, start + e["sent"]))
    return out


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The loopback Hub serving the shipped model as ``org/tiny-wan`` (and gated as ``org/gated``), its
    tokenizer.json made 2 MB (Wan's is 16.8 MB; trailing blanks, the same tokenizer)."""
    import shutil

    from diffuse.bench.hubserver import HubServer
    from diffuse.plan.shipped import shipped_models

    source = tmp_path_factory.mktemp("published") / "tiny-wan"
    shutil.copytree(shipped_models()["tiny-wan-shapes"], source)
    with open(source / TOKENIZER, "a") as f:
        f.write(" " * (2 << 20))
    with HubServer() as server:
        server.source = str(source)
        server.commit = server.publish(REPO, server.source, pipeline_tag="text-to-video")
        server.publish("org/gated", server.source, token=TOKEN)
        yield server


def hub_env(hub, who: str, home, **more) -> dict:
    """A process's environment: its own Hugging Face home and Diffuse home, the loopback Hub (log entries tagged
    ``who``), fetching allowed, short waits between retries."""
    env = subprocess_env(str(home / "diffuse"))
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        env.pop(name, None)
    env.update({"HF_HOME": str(home / "hf"), "HF_ENDPOINT": hub.endpoint(who), "DIFFUSE_HUB_OFFLINE": "0",
                "DIFFUSE_FETCH_BACKOFF": "0.05", **more})
    return env


def diffuse_cli(hub, who: str, home, *argv, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffuse.cli", *argv], env=hub_env(hub, who, home, **env),
                          capture_output=True, text=True, timeout=timeout)


def one_line(proc) -> str:
    """The one line a refused command said (``diffuse check`` gives its verdict, or why none, on stdout)."""
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    return lines[0]
