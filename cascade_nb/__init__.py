__version__ = "0.1.0"

# Modules renamed so their names can't be confused with a neighbour's (training vs train, the inference pipeline vs
# data.pipeline, interop vs interop_b). Code written against an old name keeps working: importing it gives the
# renamed module itself (the same object, so attributes and monkeypatching reach it), loaded only when asked for.
import importlib as _importlib, importlib.abc as _abc, importlib.util as _util, sys as _sys

RENAMED_MODULES = {"cascade_nb.training": "cascade_nb.run_state", "cascade_nb.pipeline": "cascade_nb.inference",
                   "cascade_nb.interop": "cascade_nb.interop_c"}

class _RenamedModuleFinder(_abc.MetaPathFinder, _abc.Loader):
    "Import `cascade_nb.<old name>` as the module it was renamed to."
    def find_spec(self, name, path=None, target=None):
        return _util.spec_from_loader(name, self) if name in RENAMED_MODULES else None
    def create_module(self, spec):
        module = _importlib.import_module(RENAMED_MODULES[spec.name])
        spec.loader_state = module.__spec__      # the import system sets __spec__ to the alias's; put it back below
        return module
    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state

if not any(isinstance(f, _RenamedModuleFinder) for f in _sys.meta_path): _sys.meta_path.append(_RenamedModuleFinder())
