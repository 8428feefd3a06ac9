"""Built-in shape analyzers, registered through the ``diffuse`` entry-point group like any plugin.

Config phase (config.json files, a weightless build and safetensors headers only, never tensor data),
in the order their needs put them:

- remote_code   refuses code shipped inside the checkpoint; imports installed component libraries
- config_reader a transformers model's verdict from config.json (depth, generates, media, encoder,
                recurrent state); refuses recurrent models and encoders alone
- stack_finder  the ModuleLists of repeated blocks, in call order
- output_kind   image, video or audio (with frame and sample rate)
- chain_check   refuses U-Nets, recurrent stacks and stackless denoisers
- config_nudger the integer config setting that sizes each stack
- side_stacks   refuses a stack sized by a config list of positions in another stack (Wan VACE's
                hints), whose outputs the denoiser adds between that stack's blocks
- two_stream    whether a stack's blocks carry two streams (forces whole steps)
- weights_check every tensor of every stack's blocks loadable on a node as the library loads it
                (renamed, converted), from the safetensors headers: refused before any node starts

Nothing here knows a model family: every answer comes from module structure,
parameter shapes, signatures and source.
"""

from diffuse.plan.hookspecs import hookimpl

from analyzers.chain_check import ChainCheck
from analyzers.config_reader import ConfigReader
from analyzers.config_nudger import ConfigNudger
from analyzers.output_kind import OutputKind
from analyzers.remote_code import RemoteCode
from analyzers.side_stacks import SideStacks
from analyzers.stack_finder import StackFinder
from analyzers.two_stream import TwoStream
from analyzers.weights_check import WeightsCheck

__all__ = ["ChainCheck", "ConfigNudger", "ConfigReader", "OutputKind", "RemoteCode", "SideStacks", "StackFinder", "TwoStream", "WeightsCheck",
           "diffuse_analyzers"]


@hookimpl
def diffuse_analyzers():
    return [RemoteCode(), ConfigReader(), StackFinder(), OutputKind(), ChainCheck(), ConfigNudger(), SideStacks(),
            TwoStream(), WeightsCheck()]
