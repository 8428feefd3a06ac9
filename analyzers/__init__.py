"""Built-in shape analyzers, registered through the ``diffuse`` entry-point group like any plugin.

Config phase (config.json files and a weightless build only, never weights),
in the order their needs put them:

- remote_code   refuses code shipped inside the checkpoint; imports installed component libraries
- config_reader a transformers model's verdict from config.json (depth, generates, media, encoder,
                recurrent state); refuses recurrent models and encoders alone
- stack_finder  the ModuleLists of repeated blocks, in call order
- output_kind   image, video or audio (with frame and sample rate)
- chain_check   refuses U-Nets, recurrent stacks and stackless denoisers
- config_nudger the integer config setting that sizes each stack
- two_stream    whether a stack's blocks carry two streams (forces whole steps)

Nothing here knows a model family: every answer comes from module structure,
parameter shapes, signatures and source.
"""

from diffuse.hookspecs import hookimpl

from analyzers.chain_check import ChainCheck
from analyzers.config_reader import ConfigReader
from analyzers.config_nudger import ConfigNudger
from analyzers.output_kind import OutputKind
from analyzers.remote_code import RemoteCode
from analyzers.stack_finder import StackFinder
from analyzers.two_stream import TwoStream

__all__ = ["ChainCheck", "ConfigNudger", "ConfigReader", "OutputKind", "RemoteCode", "StackFinder", "TwoStream", "diffuse_analyzers"]


@hookimpl
def diffuse_analyzers():
    return [RemoteCode(), ConfigReader(), StackFinder(), OutputKind(), ChainCheck(), ConfigNudger(), TwoStream()]
