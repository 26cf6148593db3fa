"""A hook that runs a function on modules of other packages once they have been imported: the
transformers routing (its modeling modules, which transformers imports lazily) and the DTensor
sharding rules (torch.distributed.tensor, too slow to import with deformconv) use it."""

import importlib.abc
import sys
from typing import Callable


class _Loader(importlib.abc.Loader):
    """A module's own loader, which runs the hook's function on the module once it has run."""

    def __init__(self, loader, hook: "AfterImport"):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._hook.installed():
            self._hook.then(module)

    def __getattr__(self, name):
        # get_source, get_filename, is_package...: linecache, inspect and torch.compile read
        # the module's source through its loader.
        return getattr(self._loader, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules whose names `wanted` accepts through the finders after it, and gives
    each a loader that calls then(module) once it has been executed, while the hook is on
    sys.meta_path."""

    def __init__(self, wanted: Callable[[str], bool], then: Callable):
        self.wanted = wanted
        self.then = then

    def installed(self) -> bool:
        return any(finder is self for finder in sys.meta_path)

    def install(self) -> None:
        if not self.installed():
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self]

    def find_spec(self, fullname, path, target=None):
        if not self.wanted(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None
