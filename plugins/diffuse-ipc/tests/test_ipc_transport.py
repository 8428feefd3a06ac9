"""The example plugin installs, is found through the entry point, and carries an exact ring."""

from __future__ import annotations

import subprocess
import sys

import families

from conftest import run_reference, run_split, subprocess_env


def test_plugin_is_registered_through_the_entry_point():
    from importlib.metadata import entry_points

    assert "diffuse_ipc" in {ep.value for ep in entry_points(group="diffuse")}
    out = subprocess.run([sys.executable, "-m", "diffuse.cli.command", "plugins"], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert out.returncode == 0
    assert any(line.split()[:2] == ["ipc", "diffuse_ipc"] for line in out.stdout.splitlines())


def test_transport_lookup_picks_the_plugin_for_ipc_only():
    from diffuse.wire.transport import transport_for

    assert transport_for("ipc:///tmp/x").scheme == "ipc"
    assert transport_for("tcp://127.0.0.1:1").scheme == "tcp"


def test_ring_over_ipc_is_byte_identical_to_plain_diffusers(models, tmp_path, diffuse_home):
    model = models("wan")
    kwargs = families.call_args("wan")
    reference = run_reference(model, kwargs, str(tmp_path / "reference.npy"))
    split, report = run_split(model, kwargs, tmp_path, nodes=2, extra=["--local-transport", "ipc"], home=diffuse_home)
    assert split.tobytes() == reference.tobytes()
    assert report["transport"] == "ipc"
