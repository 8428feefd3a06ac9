"""The per-pass contract (``diffuse.wire.passes``): every part goes to the wire and back unchanged, and what a peer
sends wrong is refused at the door naming the field, before anything in it is used."""

from __future__ import annotations

import pytest

from diffuse.wire.passes import (WHOLE, Answer, ContractError, DrawState, Embed, LayerPass, Pass, Reuse, Tail,
                            checked_tree)
from diffuse.plan.contracts import ReturnMap
from diffuse.plan.messages import Patch, SlotRef

TREE = {"args": [{"$t": 0}], "kwargs": {"temb": {"$t": 1}, "scale": 1.0}}
RMAP = ReturnMap(single=True, outputs=[0], names=["args[0]"])
SLOTS = (SlotRef(frame=0), SlotRef(frame=1, digest=b"\1" * 16))

PARTS = [
    WHOLE,
    Patch(branch=1, step=3, axis=1, tokens=64, lo=16, count=16, index=1),
    Reuse(0.1, branch=2, fresh=True),
    Reuse(0.1, branch=0, fresh=False, skip=True),
    LayerPass("DynamicCache", fresh=True),
    LayerPass("DynamicCache", False, {"3": TREE}, Tail("model.norm", (4, 5), 8), Embed(0, "bfloat16")),
    LayerPass("DynamicCache", False, None,
              Tail(None, (0, 1), 0, DrawState(True, {"keep": 0, "add": [[1, 2]]}, [["TopKLogitsWarper", {}]],
                                              b"\0" * 8))),
]


@pytest.mark.parametrize("part", PARTS, ids=lambda p: type(p).__name__)
def test_every_part_goes_to_the_wire_and_back_unchanged(part):
    sent = Pass("blocks", 7, SLOTS, part, TREE, RMAP, slot_bytes=1 << 20)
    assert Pass.from_wire(sent.to_wire(), frames=2) == sent
    again = Pass("blocks", 8, (SlotRef(digest=b"\1" * 16), SlotRef(frame=0)), part)  # plan and map known by now
    assert Pass.from_wire(again.to_wire(), frames=1) == again


def test_an_answer_goes_to_the_wire_and_back_unchanged():
    for answer in (Answer("blocks", 3, {"$t": 0}), Answer("model.layers", 4, {"ids": {"$t": 0}}, skipped=False)):
        assert Answer.from_wire(answer.to_wire()) == answer
    with pytest.raises(ContractError, match="skipped"):
        Answer.from_wire(dict(Answer("blocks", 3, None, True).to_wire(), skipped="yes"))


def wire(**changes) -> dict:
    w = Pass("blocks", 7, SLOTS, WHOLE, TREE, RMAP).to_wire()
    w.update(changes)
    return {k: v for k, v in w.items() if v is not None}


@pytest.mark.parametrize("header, said", [
    (wire(seq="7"), "integer seq"),
    (wire(seq=True), "integer seq"),
    (wire(stack=None), "name its stack"),
    (wire(slots={"0": 1}), "list its slots"),
    (wire(slots=[["f", 5]]), "slot reference"),
    (wire(slot_bytes=-1), "bytes of tensors"),
    (wire(tree={"args": [{"$t": 2}], "kwargs": {}}), "tensor number 2"),
    (wire(tree={"args": [{"$code": "x"}], "kwargs": {}}), "unknown marker"),
    (wire(rmap={"single": True}), "return map"),
    (wire(rmap={"single": False, "outputs": [0, None], "names": ["h", None], "sides": [1]}), "sides"),
    (wire(rmap={"single": False, "outputs": [0, 1], "names": ["h", "b"], "sides": [0]}), "sides"),
    (wire(patch={"branch": "x"}), "patch"),
    (wire(reuse={"t": -1, "branch": 0, "fresh": False}), "reuse"),
    (wire(reuse={"t": 0.1, "branch": 0, "fresh": False}, skip="no"), "skip"),
    (wire(skip=True), "skip"),
    (wire(state={"kind": 3}), "cache state"),
    (wire(state={"kind": "DynamicCache", "fresh": 1}), "cache state"),
    (wire(layer_trees={"0": [1]}), "call plan"),
    (wire(layer_trees=[TREE]), "per-layer call plans"),
    (wire(tail={"rows": [0], "top": 1}), "tail"),
    (wire(tail={"rows": [0, 1], "top": 1, "draw": {"sample": "yes"}}), "draw"),
    (wire(tail={"rows": [0, 1], "top": 1, "draw": {"sample": True, "history": {}, "rng": "x"}}), "generator state"),
    (wire(embed={"slot": "0", "dtype": "float32"}), "embed"),
    (wire(embed={"slot": 0, "dtype": "int64"}), "not a float dtype"),
    (wire(embed={"slot": 9, "dtype": "float32"}), "hidden state"),
    (wire(patch=Patch(0, 1, 1, 8, True).to_wire(), state={"kind": "DynamicCache", "fresh": False}), "one part"),
    (wire(reuse={"t": 0.1, "branch": 0, "fresh": False}, state={"kind": "DynamicCache"}), "whole steps"),
])
def test_a_malformed_call_is_refused_at_the_door_naming_its_field(header, said):
    with pytest.raises(ContractError, match=said):
        Pass.from_wire(header, frames=2)


def test_a_call_plan_deeper_than_allowed_is_refused_before_it_is_walked_further():
    deep = 0
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ContractError, match="nested deeper"):
        checked_tree({"args": [deep], "kwargs": {}}, "call plan", 1)


def test_a_return_map_with_threaded_side_outputs_travels_and_names_its_hidden_stream():
    """A side output handed on (T5's position biases) is threaded into a later slot; the hidden state stays the
    stream the tail reads."""
    rmap = ReturnMap(False, [0, None, None], ["args[0]", "side output", "side output"]).with_sides({1: 4, 2: 5})
    assert rmap.streams == [0, 4, 5] and rmap.hidden_streams == [0] and rmap.sides == (1, 2)
    assert ReturnMap.from_dict(rmap.to_dict(), slots=6) == rmap


def test_inner_layers_asked_for_travel_in_the_pass_and_a_malformed_ask_is_refused():
    """``LayerPass.keep``: the layers whose hidden states come back, and how many the message's last frames
    already carry; refused at the door where the layers are not ascending or ``kept`` counts frames not there."""
    p = LayerPass(None, keep=(0, 1, 4), kept=2)
    w = Pass("text_encoder.layers", 1, (SlotRef(frame=0),), part=p).to_wire()
    assert w["keep"] == {"layers": [0, 1, 4], "kept": 2}
    assert Pass.from_wire(w, frames=3).part == p
    with pytest.raises(ContractError, match="kept counts outputs"):
        Pass.from_wire(w, frames=1)
    for keep in ({"layers": [1, 1], "kept": 0}, {"layers": [2, 1], "kept": 0}, {"layers": [], "kept": 0},
                 {"layers": [-1], "kept": 0}, {"layers": [0], "kept": 2}, {"layers": "0", "kept": 0},
                 {"layers": [0]}, {"layers": list(range(1025)), "kept": 0}):
        with pytest.raises(ContractError, match="malformed keep"):
            Pass.from_wire(dict(w, keep=keep), frames=3)
