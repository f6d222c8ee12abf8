"""Running code right after a module is imported, without importing it early.

vLLM runs its general plugins from places (argument parsing, the model registry's
subprocesses) where importing its engine client would be early or wasteful, so
:func:`after_import` waits for the modules to be imported by vLLM itself."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


def after_import(names: tuple[str, ...], then: Callable[[], None]) -> None:
    """Calls ``then`` once every module of ``names`` is imported (now, if they are)."""
    if all(n in sys.modules for n in names):
        then()
        return
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(names, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of each watched module so that
    ``then`` runs right after the last of them has executed."""

    def __init__(self, names: tuple[str, ...], then: Callable[[], None]):
        self.names, self.then = names, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            if all(n in sys.modules for n in self.names):
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                self.then()

        spec.loader = _Loader(spec.loader, exec_module)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, real, exec_module):
        self.real, self._exec = real, exec_module

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        self._exec(module)
