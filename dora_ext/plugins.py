"""The plugin manager: built-in defaults plus third-party plugins from the `dora_ext` entry points."""

from __future__ import annotations

import pluggy

from . import defaults, hookspecs

ENTRY_POINT_GROUP = "dora_ext"


def get_plugin_manager(*, load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the hookspecs, the built-in plugin and (optionally) installed plugins.

    Registration is inspectable: ``pm.list_name_plugin()`` names every plugin that is active.
    """
    pm = pluggy.PluginManager("dora_ext")
    pm.add_hookspecs(hookspecs)
    pm.register(defaults, name="dora_ext.defaults")
    if load_entrypoints:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm
