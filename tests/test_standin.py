"""The stand-in's contract with the denoiser's own loop (unit level: no ring involved).

The stand-in answers for a whole stack at its first block; the later proxies
must receive that answer untouched. These tests drive ``StandIn`` directly,
with a local function in place of the ring, to pin that rule down.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffuse.errors import DiffuseError
from diffuse.plan.contracts import StackPlan
from diffuse.client.proxies import StandIn


class LocalStack:
    """Answers a stack call by running real blocks here (what a ring of nodes would return)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def run_stack(self, stack, args, kwargs):
        x = args[0]
        for b in self.blocks:
            x = b(x)
        return x


def _stand_in(n=3):
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4) for _ in range(n)]
    return blocks, StandIn(StackPlan(path="blocks", length=n, block_class="Linear"), LocalStack(blocks))


def test_a_plain_chain_gets_the_stacks_answer():
    blocks, stand_in = _stand_in()
    x = torch.randn(2, 4)
    h = x
    for proxy in stand_in:
        h = proxy(h)
    expected = x
    for b in blocks:
        expected = b(expected)
    assert torch.equal(h, expected)


def test_work_between_blocks_is_refused_not_lost():
    _, stand_in = _stand_in()
    h = torch.randn(2, 4)
    with pytest.raises(DiffuseError, match=r"changes what blocks\[0\] returned before it calls blocks\[1\]"):
        for proxy in stand_in:
            h = proxy(h) + 1.0  # a residual added between blocks


def test_blocks_out_of_order_are_refused():
    _, stand_in = _stand_in()
    h = stand_in[0](torch.randn(2, 4))
    with pytest.raises(DiffuseError, match="not run this stack as a chain"):
        stand_in[2](h)


class _PlannedStack(LocalStack):
    """Answers ``(hidden, bias)`` as a block returning a side output would; its plan's return map threads only
    the hidden state (the bias replaces no input of block 0, which was handed None)."""

    def __init__(self, blocks):
        from diffuse.plan.contracts import ReturnMap

        super().__init__(blocks)
        self.plan = type("Plan", (), {"return_maps": {"blocks": ReturnMap(False, [0, None], ["args[0]", None])}})()

    def run_stack(self, stack, args, kwargs):
        return super().run_stack(stack, args, kwargs), torch.ones(2)


def test_a_side_output_handed_on_where_block_zero_took_none_is_refused_for_a_whole_call():
    """The nodes call every block of a whole call as block 0 was called: a model handing block 1 what block 0
    returned beside its hidden state (where block 0 got None) would be answered wrong, so it is refused."""
    blocks = [nn.Linear(4, 4) for _ in range(3)]
    stand_in = StandIn(StackPlan(path="blocks", length=3, block_class="Linear"), _PlannedStack(blocks))
    h, bias = stand_in[0](torch.randn(2, 4), None)
    with pytest.raises(DiffuseError, match=r"hands what blocks\[0\] returned besides its hidden state to blocks\[1\]"):
        stand_in[1](h, bias)



class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads, self.sizes = 2, (4, 8)
        self.norm, self.proj, self.mlp = nn.LayerNorm(4), nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8))

    def forward(self, x):
        return self.mlp(self.proj(self.norm(x)))


def test_a_blocks_attributes_read_outside_the_loop_are_served_and_its_weights_values_refused():
    """What the model reads of a proxy outside the loop comes from the block's weightless copy: plain values and
    weights' shapes and dtypes as the block has them; a weight's values and a call into the block are refused,
    naming what was read."""
    from diffuse.client.blockreads import ReadsBlocks

    blocks = nn.ModuleList([_Block() for _ in range(2)]).to("meta")  # as the client holds them once handed out
    stand_in = StandIn(StackPlan(path="blocks", length=2, block_class="_Block"), LocalStack(blocks), blocks)
    first = stand_in[0]
    assert first.heads == 2 and first.sizes == (4, 8) and first.norm.normalized_shape == (4,)
    assert first.proj.weight.shape == (8, 4) and first.proj.weight.dtype == torch.float32
    assert first.proj.in_features == 4 and len(first.mlp) == 1 and first.mlp[0].out_features == 8
    assert first.proj.weight.size(0) == 8 and first.proj.bias.dim() == 1 and first.proj.bias.numel() == 8
    x = torch.randn(2, 8)
    for read in (lambda: x + first.proj.bias, lambda: first.proj.bias * x, lambda: torch.sigmoid(first.proj.bias),
                 lambda: float(first.proj.bias[0]), lambda: first.proj.bias.sum()):
        with pytest.raises(ReadsBlocks, match=r"reads( the values of)? blocks\[0\]\.proj\.bias"):
            read()
    with pytest.raises(ReadsBlocks, match=r"calls blocks\[0\]\.mlp\[0\] outside the loop over blocks"):
        first.mlp[0](x)
    with pytest.raises(AttributeError):
        first.no_such_attribute
    without = StandIn(StackPlan(path="blocks", length=2, block_class="_Block"), LocalStack(blocks))[0]
    assert not hasattr(first, "_private") and not hasattr(without, "heads")  # no blocks given: nothing served
