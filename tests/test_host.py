"""``diffuse host``: the browser over the Hub's search, driven through a pseudo-terminal whose screen a terminal
emulator (pyte) keeps, against the loopback Hub (``diffuse.bench.hubserver``) serving three models."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from conftest import subprocess_env

pyte = pytest.importorskip("pyte")

COLUMNS, LINES = 160, 40
DOWN, ENTER, ESC, RIGHT = "\x1bOB", "\r", "\x1b", "\x1bOC"  # arrows as a terminal in keypad mode sends them


class Terminal:
    """A process on a pseudo-terminal of COLUMNS x LINES, its output kept on a pyte screen as it comes."""

    def __init__(self, argv: list[str], env: dict):
        self.screen = pyte.Screen(COLUMNS, LINES)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = bytearray()
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.master = master
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.raw += data
                self.stream.feed(data)

    def text(self) -> str:
        with self.lock:
            return "\n".join(self.screen.display)

    def wait_for(self, what: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if what in self.text():
                return self.text()
            assert self.proc.poll() is None or what in self.text(), self.text()
            time.sleep(0.05)
        raise AssertionError(f"{what!r} not on the screen:\n{self.text()}")

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def row(self, name: str, marked: bool = True, timeout: float = 30) -> str:
        """The screen's line for model ``name``, once it is (``marked``) or is not the chosen row."""
        deadline = time.monotonic() + timeout
        while True:
            line = next((ln for ln in self.text().splitlines() if name in ln), "")
            if line.startswith(">") == marked or time.monotonic() > deadline:
                return line
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from diffuse.bench.hubserver import HubServer
    from diffuse.plan.shipped import shipped_models

    odd = tmp_path_factory.mktemp("odd")
    with open(odd / "config.json", "w") as f:
        json.dump({"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 100}, f)
    shutil.copy(os.path.join(shipped_models()["tiny-qwen-chat"], "model.safetensors"), odd / "model.safetensors")
    with HubServer() as server:
        server.publish("org/tiny-wan", shipped_models()["tiny-wan-shapes"], pipeline_tag="text-to-video",
                       downloads=900, likes=3)
        server.publish("org/tiny-chat", shipped_models()["tiny-qwen-chat"], pipeline_tag="text-generation",
                       downloads=500, likes=9)
        server.publish("org/an-encoder", str(odd), pipeline_tag="feature-extraction", downloads=100)
        yield server


def test_the_browser_judges_each_model_shows_its_page_goes_back_where_it_was_and_hosts_a_slice(hub, tmp_path):
    env = dict(subprocess_env(str(tmp_path / "diffuse")), HF_HOME=str(tmp_path / "hf"), DIFFUSE_HUB_OFFLINE="0",
               HF_ENDPOINT=hub.endpoint("host"), TERM="xterm", DIFFUSE_FETCH_BACKOFF="0.05")
    term = Terminal([sys.executable, "-m", "diffuse.cli", "host", "--listen", "tcp://127.0.0.1:0"], env)
    try:
        screen = term.wait_for("org/an-encoder")
        lines = screen.splitlines()
        order = [next(i for i, ln in enumerate(lines) if name in ln) for name in ("tiny-wan", "tiny-chat", "an-encoder")]
        assert order == sorted(order), screen  # most downloaded first
        term.wait_for("refused:")  # every row judged from its configs and headers
        screen = term.wait_for("splittable: text")
        row = next(ln for ln in screen.splitlines() if "org/tiny-wan" in ln)
        assert "splittable: video, blocks (4)" in row and "all of it" in row, row
        assert "this machine:" in screen and "of memory free" in screen
        assert "fetching" not in screen and "INFO" not in screen  # nothing scribbled over it
        # only configs and headers came for the verdicts
        assert hub.fetched("host", ".safetensors") < 60_000
        term.send("t")  # the first task filter: text-to-video
        screen = term.wait_for("task text-to-video")
        term.wait_for("splittable: video")
        assert "org/tiny-chat" not in term.text()
        for _ in range(7):  # round to "all" again
            term.send("t")
            time.sleep(0.1)
        term.wait_for("task all")
        term.wait_for("org/an-encoder")
        term.send(DOWN)  # the second row, tiny-chat ...
        assert term.row("org/tiny-chat").startswith(">"), term.text()
        term.send(ENTER)  # ... its page ...
        page = term.wait_for("what a node fetches")
        assert "org/tiny-chat@" in page and "card:" in page and "tiny-qwen-chat" in page, page
        assert "model.safetensors" in page and "1/2" in page and "4/4" in page
        term.send(ESC)  # ... and back, on the same row
        term.wait_for("this machine holds")
        assert term.row("org/tiny-chat").startswith(">"), term.text()
        term.send(ENTER)
        term.wait_for("what a node fetches")
        term.send(RIGHT)  # 2/2
        term.wait_for("h hosts blocks 2/2")
        before = hub.fetched("host", ".safetensors")
        term.send("h")
        term.wait_for('"diffuse_node"', timeout=120)  # the node's ready line: it serves
        assert "hosting org/tiny-chat@" in term.text()
        got = hub.fetched("host", "model.safetensors") - before
        import struct as st

        with open(os.path.join(hub.repos["org/tiny-chat"].commits[hub.repos["org/tiny-chat"].main],
                               "model.safetensors"), "rb") as f:
            (n,) = st.unpack("<Q", f.read(8))
            meta = json.loads(f.read(n))
        layers = {k: v["data_offsets"] for k, v in meta.items() if k.startswith("model.layers.")}
        mine = sum(b - a for k, (a, b) in layers.items() if int(k.split(".")[2]) >= 2)
        assert 0 < got <= 1.05 * mine + os.path.getsize(f.name) - sum(b - a for a, b in layers.values()), got
    finally:
        term.close()


def test_host_without_a_terminal_says_how_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "diffuse.cli", "host"], env=subprocess_env(str(tmp_path)),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "terminal" in run.stderr
