"""Guidance branches on separate groups of nodes, against plain diffusers run whole in a subprocess.

Wan calls its transformer once per branch: from the second step the call that follows is sent ahead to
the other group. PixArt-Sigma batches both branches in one call: the batch is cut between the groups.
Through one group of nodes or two, one node per group or two, the output is byte for byte the same, with
the client's memo of repeated projections (``diffuse.client.memo``) on for every projection, however small.
"""

from __future__ import annotations

import families
import pytest
import torch

from conftest import THREADS, Reference, run_split

CASES = [("wan", ["--local-nodes", "2", "--branch-groups", "2"]),
         ("wan", ["--local-nodes", "4", "--branch-groups", "2"]),
         ("pixart_sigma", ["--local-nodes", "2", "--branch-groups", "2"])]


@pytest.mark.parametrize("name,flags", CASES, ids=["wan-1+1", "wan-2+2", "pixart-1+1"])
def test_branches_on_two_groups_equal_the_whole_model(name, flags, models, tmp_path, diffuse_home, monkeypatch):
    monkeypatch.setattr("diffuse.client.memo.MIN_ELEMENTS", 1)  # the client's memo on every projection (tiny inputs too)
    model = models(name)
    kwargs = dict(families.call_args(name), num_inference_steps=3)
    whole = Reference(model, kwargs, str(tmp_path / "whole.npy"))  # side by side with the split run
    split, report = run_split(model, kwargs, tmp_path, nodes=int(flags[1]), extra=flags[2:], home=diffuse_home)
    whole = whole.result()
    assert split.tobytes() == whole.tobytes()
    assert report["client_reused"] > 0  # the prompt's projections (and the second call's timestep) were reused
    branches = report["branches"]
    assert len(report["node_stats"]) == int(flags[1])
    if name == "wan":  # steps 2 and 3: the second call of each was sent ahead, and used
        assert branches["ahead_used"] == 2 and branches["ahead_dropped"] == 0 and branches["batches_cut"] == 0
    else:  # one call per step, its batch of two cut in halves
        assert branches["batches_cut"] == 3 and branches["ahead_used"] == 0
    # both groups computed: every node ran passes
    assert all(n["messages"] > 0 for n in report["node_stats"]), report["node_stats"]


def test_group_mistakes_are_one_line_before_anything_starts(models, tmp_path, diffuse_home):
    from conftest import run_client

    model = models("wan")
    for flags, why in ((["--local-nodes", "3", "--branch-groups", "2"], "cannot be shared evenly"),
                       (["--nodes", "tcp://127.0.0.1:1;", "--prompt", "x"], "an empty group"),
                       (["--nodes", "tcp://127.0.0.1:1;tcp://127.0.0.1:2", "--branch-groups", "3"],
                        "--nodes lists 2 group(s)")):
        run = run_client(["--model", model, "--prompt", "x", "--steps", "1", "--quiet", *flags,
                          "--out", str(tmp_path / "o.mp4")], diffuse_home)
        assert run.returncode == 2 and why in run.stderr, run.stderr[-1500:]
        assert "Traceback" not in run.stderr
    torch.set_num_threads(THREADS)
