"""The import hook behind ``python -m amp.apex enable``: Apex-era imports served by this package.

The ``.pth`` line that ``enable`` writes loads this file by path (not as ``amp._apex_finder``) at
the start of every Python process of the environment, so it imports nothing at module level but
``importlib.machinery`` (a thin name for the import system itself): amp, ``importlib.util`` and
``importlib.metadata`` are imported only when an ``apex`` module (or ``amp_C``, ``apex_C``) is
imported, or when a metadata probe asks for ``apex`` by name.

Who answers ``apex.<name>...`` is decided per first-level name, at import time:

* NVIDIA Apex is installed (an ``apex`` package on ``sys.path``) and ships ``apex/<name>``: Apex,
  for everything below it too. A module its package lacks (``apex.optimizers.something_old``) stays
  Apex's own ``ModuleNotFoundError``: one of ours inside its package would mix two
  implementations (an old Apex that ships ``apex.amp`` must never get our ``apex.amp.scaler``).
* otherwise amp, where it has the module: ``PACKAGES`` maps a name onto a package of ours that
  *is* it (``apex.amp is amp``, ``apex.amp.frontend is amp.frontend``: state is shared); every
  other module comes from the mirror ``amp._apex.apex``, Apex's layout rebuilt on amp
  (``apex.parallel.LARC``, ``apex.multi_tensor_apply.multi_tensor_apply``), which also holds the
  modules a package of ``PACKAGES`` lacks (``apex.amp.<name>`` that amp itself has no module for).
* ``apex`` itself is NVIDIA Apex's where it is installed, else the mirror's (``apex.__file__``
  exists). ``amp_C`` and ``apex_C``, Apex's extensions that Apex-era scripts import at the top,
  are NVIDIA Apex's where it is installed, else the mirror's stand-ins (``amp._apex.amp_C``,
  ``amp._apex.apex_C``): Apex's op names on amp's ops, with amp's built ``amp_C`` behind them.

A module served here is the same module object as its target, registered under both names.
"""
import sys
from importlib.machinery import ModuleSpec, PathFinder

__all__ = ["PACKAGES", "MIRROR", "EXTENSIONS", "ApexAliasFinder", "nvidia_apex_spec",
           "nvidia_apex_ships", "find", "install", "installed_finder"]

#: ``apex.<name>`` -> the package of ours that is it (its modules answer below it).
PACKAGES = {"amp": "amp", "fp16_utils": "fp16_utils", "optimizers": "amp.optimizers",
            "normalization": "amp.normalization"}
#: Apex's installed layout on top of amp: ``<MIRROR>.apex.<path>`` answers ``apex.<path>``.
MIRROR = "amp._apex"
#: Apex's compiled extensions, which the mirror stands in for where none is installed.
EXTENSIONS = ("amp_C", "apex_C")


def nvidia_apex_spec():
    """The spec of an ``apex`` package on ``sys.path`` (NVIDIA's), or None; meta-path hooks ignored."""
    return PathFinder.find_spec("apex")


def nvidia_apex_ships(name, apex_spec):
    """Whether the NVIDIA Apex of ``apex_spec`` has a module or package ``apex.<name>``."""
    return PathFinder.find_spec("apex." + name, apex_spec.submodule_search_locations) is not None


def find(name):
    """The spec of module ``name``, or None where there is none. Nothing is imported, so that
    ``importlib.util.find_spec("apex")`` (a probe many libraries make) stays cheap: the top-level
    package is found by the import system's finders, the rest by path below it."""
    import importlib.util

    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = PathFinder.find_spec(".".join(parts[:depth]), spec.submodule_search_locations)
    return spec


class _AliasLoader:
    """Loads a name as the already importable module ``target`` itself."""

    def __init__(self, target, mirror):
        self.target = target
        self.mirror = mirror

    def create_module(self, spec):
        import importlib

        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        # Register the target's submodules under the alias too: ``import apex.amp._amp_state`` then
        # finds them in sys.modules, instead of being loaded again and bound onto ``amp`` over the
        # attribute of the same name (``amp._amp_state`` is the state object, not its module).
        prefix = self.target + "."
        for name, submodule in list(sys.modules.items()):
            if name.startswith(prefix):
                sys.modules.setdefault(spec.name + name[len(self.target):], submodule)
        self._register_mirror_modules(spec.name, module)
        return module

    def _register_mirror_modules(self, alias, module):
        # The mirror's modules below a package of ours (apex.amp's ``utils``, ``wrap``, ...) are
        # imported with it and are its attributes, as Apex's package imported them all: code reads
        # ``apex.amp._process_optimizer.<name>`` without importing it. Registered here, they are
        # found in sys.modules when imported by name, so the import system never binds one over an
        # attribute of the same name (apex.amp's ``__version__`` module, amp's ``__version__`` string).
        import importlib
        import pkgutil

        mirror_package = f"{self.mirror}.{alias}"
        if mirror_package == self.target or getattr(module, "__path__", None) is None:
            return
        mirror_spec = find(mirror_package)
        if mirror_spec is None or mirror_spec.submodule_search_locations is None:
            return
        for info in pkgutil.iter_modules(mirror_spec.submodule_search_locations):
            if find(f"{self.target}.{info.name}") is not None:
                continue  # the package's own module of that name answers
            submodule = importlib.import_module(f"{mirror_package}.{info.name}")
            sys.modules.setdefault(f"{alias}.{info.name}", submodule)
            if not hasattr(module, info.name):
                setattr(module, info.name, submodule)

    def exec_module(self, module):
        # The import system stamped the alias's spec on the module: it keeps its own.
        module.__spec__ = self._own_spec

    def get_code(self, fullname):
        """The target's code: ``python -m apex.parallel.multiproc`` runs it through runpy."""
        spec = find(self.target)
        get_code = getattr(spec.loader if spec is not None else None, "get_code", None)
        if get_code is None:
            raise ImportError(f"no code object available for {fullname} ({self.target})", name=fullname)
        return get_code(self.target)


def _apex_distribution_class():
    """World (a): the metadata that ``importlib.metadata.version("apex")`` and friends read.
    Built on first use: importing ``importlib.metadata`` costs every start-up ~10 ms."""
    import importlib.metadata
    import pathlib
    import re

    amp_dir = pathlib.Path(__file__).resolve().parent

    class ApexDistribution(importlib.metadata.Distribution):
        def read_text(self, filename):
            if filename == "METADATA":
                text = (amp_dir / "__init__.py").read_text()
                match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
                version = match.group(1) if match else "0"
                return (f"Metadata-Version: 2.1\nName: apex\nVersion: {version}\n"
                        "Summary: amp's drop-in for NVIDIA Apex (python -m amp.apex status)\n")
            if filename == "top_level.txt":
                return "apex\n"
            return None

        def locate_file(self, path):
            return amp_dir.parent / path

    return ApexDistribution


class ApexAliasFinder:
    """A ``sys.meta_path`` finder answering ``apex``, ``apex.*``, ``amp_C`` and ``apex_C`` as above."""

    amp_apex_dropin = True  # how ``status`` recognises it, whichever copy of this module made it

    def __init__(self, mirror=MIRROR):
        self.mirror = mirror

    def target(self, fullname):
        """The module of ours that answers ``fullname`` in this process, or None (NVIDIA Apex's,
        another module's, or nobody's). Imports nothing."""
        if fullname in EXTENSIONS:
            return None if nvidia_apex_spec() is not None else f"{self.mirror}.{fullname}"
        if fullname != "apex" and not fullname.startswith("apex."):
            return None
        apex_spec = nvidia_apex_spec()
        if fullname == "apex":
            return None if apex_spec is not None else f"{self.mirror}.apex"
        head, _, tail = fullname[len("apex."):].partition(".")
        if apex_spec is not None and nvidia_apex_ships(head, apex_spec):
            return None
        candidates = [f"{self.mirror}.{fullname}"]
        if head in PACKAGES:
            candidates.insert(0, PACKAGES[head] + ("." + tail if tail else ""))
        return next((name for name in candidates if find(name) is not None), None)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in EXTENSIONS and fullname != "apex" and not fullname.startswith("apex."):
            return None  # the fast path: every other import of the process
        alias_target = self.target(fullname)
        if alias_target is None:
            return None
        # A loader by protocol: subclassing importlib.abc.Loader would import importlib.abc (and
        # with it importlib.resources, zipfile, ...) at every start-up.
        return ModuleSpec(fullname, _AliasLoader(alias_target, self.mirror))  # type: ignore[arg-type]

    def find_distributions(self, context=None):
        """``apex``'s metadata, world (a) only, and only to a probe that asks for it by name:
        listings of every distribution (pip's ``freeze``, ``install``, ``uninstall``) never see
        it, so pip never takes the stand-in for an installed NVIDIA Apex."""
        name = getattr(context, "name", None)
        if name is None or name.lower() != "apex" or nvidia_apex_spec() is not None:
            return iter(())
        return iter((_apex_distribution_class()(),))


def installed_finder():
    """The drop-in finder on ``sys.meta_path`` of this process, or None."""
    return next((f for f in sys.meta_path if getattr(f, "amp_apex_dropin", False)), None)


def install():
    """Put the finder first on ``sys.meta_path`` (once per process)."""
    if installed_finder() is None:
        sys.meta_path.insert(0, ApexAliasFinder())
