"""The plugin manager: built-ins and third parties arrive the same way.

Every plugin is found through the ``diffuse`` entry-point group. Hook
implementations are validated when they register, so a plugin whose hook does
not match its spec fails at load with its name, not later with a wrong result.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import entry_points

import pluggy

from diffuse.plan import hookspecs
from diffuse.errors import PluginError

log = logging.getLogger("diffuse.plan.plugins")

ENTRY_POINT_GROUP = "diffuse"


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken third-party package must name itself
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {exc}") from exc
        try:
            pm.register(plugin, name=ep.name)
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) breaks a hook contract: {exc}") from exc


@functools.lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every installed plugin registered."""
    pm = pluggy.PluginManager("diffuse")
    pm.add_hookspecs(hookspecs)
    _load_entry_points(pm)
    if not pm.get_plugins():
        raise PluginError(
            "no diffuse plugins are installed (not even the built-ins): "
            "install the package with `pip install -e .` so its entry points exist"
        )
    return pm


def plugin_names() -> list[str]:
    pm = plugin_manager()
    return sorted(pm.get_name(p) for p in pm.get_plugins())


def call_hook(name: str, **kwargs):
    """Call a hook; an exception inside a plugin is re-raised naming the plugin."""
    pm = plugin_manager()
    hook = getattr(pm.hook, name)
    try:
        return hook(**kwargs)
    except PluginError:
        raise
    except Exception as exc:
        owner = _owner_of(exc, hook)
        raise PluginError(f"plugin {owner!r} raised in {name}: {type(exc).__name__}: {exc}") from exc


def _owner_of(exc: BaseException, hook) -> str:
    tb = exc.__traceback__
    files = {}
    for impl in hook.get_hookimpls():
        fn = impl.function
        files[getattr(fn, "__code__", None) and fn.__code__.co_filename] = impl.plugin_name
    while tb is not None:
        name = files.get(tb.tb_frame.f_code.co_filename)
        if name:
            return name
        tb = tb.tb_next
    return "unknown"
