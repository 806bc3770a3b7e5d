"""A module imported on first use, for code whose listing must not pay for it: the objectives in
``trainers/objectives/`` reach torch through ``lazy_import("torch")``, so registering a method (``harness methods``,
config validation) reads its hyper-parameters, inputs and notes without loading torch (about 2 s, more on busy cores).
"""

from __future__ import annotations

import importlib
import sys
import types


class LazyModule(types.ModuleType):
    """Stands in for the module named ``__name__``: the first attribute read imports it, every read is served by it."""

    def __getattr__(self, attr: str) -> object:
        module = sys.modules.get(self.__name__) or importlib.import_module(self.__name__)
        return getattr(module, attr)


def lazy_import(name: str) -> types.ModuleType:
    """The module ``name`` if it is already imported, else a :class:`LazyModule` that imports it when first used."""
    return sys.modules.get(name) or LazyModule(name)
