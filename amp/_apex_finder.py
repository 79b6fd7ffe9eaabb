"""The import hook behind ``python -m amp.apex enable``: ``apex.amp`` and friends are this package.

It uses the standard library only and never imports ``amp`` until an ``apex`` module is imported,
because the ``.pth`` file written by ``enable`` loads it (by path, not as ``amp._apex_finder``)
at the start of every Python process of the environment.

Two worlds:

(a) No NVIDIA Apex on ``sys.path``: ``apex`` is an empty package of ours, and every entry of
    ``ALIASES`` and ``ALIASES_WITHOUT_NVIDIA_APEX`` answers; ``importlib.metadata`` knows a
    distribution ``apex`` (what libraries probe before ``from apex import amp``).
(b) NVIDIA Apex is installed: ``apex`` and everything it ships stay its own; only the names of
    ``ALIASES`` that it no longer ships (``amp``, ``fp16_utils``) answer, as its submodules.

An alias is the same module object as its target (``apex.amp is amp``), so state is shared.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import pathlib
import re
import sys

__all__ = ["ALIASES", "ALIASES_WITHOUT_NVIDIA_APEX", "ApexAliasFinder", "install", "installed_finder"]

#: ``apex.<name>`` -> our module, in both worlds (unless the installed Apex ships ``<name>``).
ALIASES = {"amp": "amp", "fp16_utils": "fp16_utils"}
#: ``apex.<name>`` -> our module, only where no NVIDIA Apex is installed (it ships these itself).
ALIASES_WITHOUT_NVIDIA_APEX = {
    "multi_tensor_apply": "amp.multi_tensor_apply",
    "optimizers": "amp.optimizers",
    "parallel": "amp.parallel",
}

_AMP_DIR = pathlib.Path(__file__).resolve().parent


def nvidia_apex_spec():
    """The spec of an ``apex`` package on ``sys.path`` (NVIDIA's), or None; meta-path hooks ignored."""
    return importlib.machinery.PathFinder.find_spec("apex")


class _AliasLoader(importlib.abc.Loader):
    """Loads ``apex.<name>`` as the already importable module ``target`` itself."""

    def __init__(self, alias, target):
        self.alias = alias
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        # Register the target's submodules under the alias too: ``import apex.amp._amp_state`` then
        # finds them in sys.modules, instead of being loaded again and bound onto ``amp`` over the
        # attribute of the same name (``amp._amp_state`` is the state object, not its module).
        prefix = self.target + "."
        for name, submodule in list(sys.modules.items()):
            if name.startswith(prefix):
                sys.modules.setdefault(self.alias + name[len(self.target):], submodule)
        return module

    def exec_module(self, module):
        # The import system stamped the alias's spec on the module: it keeps its own.
        module.__spec__ = self._own_spec


class _ApexPackageLoader(importlib.abc.Loader):
    """World (a): ``apex`` itself, an empty package whose submodules are the aliases."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__doc__ = ("amp's stand-in for NVIDIA Apex (python -m amp.apex status): apex.amp is "
                          "amp, apex.fp16_utils is fp16_utils, apex.parallel is amp.parallel.")

        # Apex's own __init__ imported amp and friends, so `import apex; apex.amp....` worked:
        # imported on first access here, to keep `import apex` itself light.
        def __getattr__(name):
            if name in ALIASES or name in ALIASES_WITHOUT_NVIDIA_APEX:
                return importlib.import_module("apex." + name)
            raise AttributeError(f"module 'apex' has no attribute {name!r}")

        module.__getattr__ = __getattr__


def _amp_version():
    text = (_AMP_DIR / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "0"


class _ApexDistribution(importlib.metadata.Distribution):
    """World (a): the metadata that ``importlib.metadata.version("apex")`` and friends read."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: apex\nVersion: {_amp_version()}\n"
                    "Summary: amp's drop-in for NVIDIA Apex's amp, fp16_utils and parallel\n")
        if filename == "top_level.txt":
            return "apex\n"
        return None

    def locate_file(self, path):
        return _AMP_DIR.parent / path


class ApexAliasFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder answering ``apex`` and ``apex.*`` as described above."""

    amp_apex_dropin = True  # how ``status`` recognises it, whichever copy of this module made it

    def _target(self, head, nvidia_apex):
        if nvidia_apex is None:
            return ALIASES.get(head) or ALIASES_WITHOUT_NVIDIA_APEX.get(head)
        if head not in ALIASES:
            return None
        # Never shadow what the installed Apex still ships.
        shipped = importlib.machinery.PathFinder.find_spec(
            "apex." + head, nvidia_apex.submodule_search_locations)
        return None if shipped is not None else ALIASES[head]

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "apex" and not fullname.startswith("apex."):
            return None
        nvidia_apex = nvidia_apex_spec()
        if fullname == "apex":
            if nvidia_apex is not None:
                return None
            return importlib.machinery.ModuleSpec("apex", _ApexPackageLoader(), is_package=True)
        head, _, tail = fullname[len("apex."):].partition(".")
        alias_target = self._target(head, nvidia_apex)
        if alias_target is None:
            return None
        if tail:
            alias_target += "." + tail
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, alias_target))

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is not None and re.sub(r"[-_.]+", "-", context.name).lower() != "apex":
            return iter(())
        if nvidia_apex_spec() is not None:
            return iter(())
        return iter((_ApexDistribution(),))


def installed_finder():
    """The drop-in finder on ``sys.meta_path`` of this process, or None."""
    return next((f for f in sys.meta_path if getattr(f, "amp_apex_dropin", False)), None)


def install():
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if installed_finder() is None:
        sys.meta_path.insert(0, ApexAliasFinder())
