"""``python -m amp.apex enable | disable | status``: the opt-in switch for Apex-era code.

``enable`` writes one file of ours, ``amp-apex-dropin.pth``, into this environment's
site-packages (or ``--user``'s, or ``--site DIR``). Python runs its one line at every start-up
(torchrun workers, spawned processes and libraries' probes included): it loads
``amp/_apex_finder.py`` by path and puts its finder first on ``sys.meta_path``, so that
``from apex import amp`` and friends resolve to this package (see that module for the two
worlds, with and without NVIDIA Apex). The line fails soft: if amp is uninstalled or moved it does
nothing. ``disable`` removes the file; nothing else is ever written, and no other distribution's
files are touched. Processes already running are not affected either way.

``python -S`` (no ``site``) processes no ``.pth`` file, so the switch does not reach it; ``python
-I`` and ``-s`` skip the user site, which ``--user`` writes to.
"""
from __future__ import annotations

import argparse
import os
import site
import sys
import sysconfig
from pathlib import Path
from typing import Sequence

from . import _apex_finder

__all__ = ["PTH_NAME", "enable", "disable", "status", "main"]

PTH_NAME = "amp-apex-dropin.pth"
_FINDER_FILE = Path(_apex_finder.__file__).resolve()


def _pth_line(finder_file: Path) -> str:
    # One line (site.py executes lines that start with "import"), failing soft: a missing or
    # broken amp must never break Python's start-up.
    body = ("try:\n"
            " from importlib.util import spec_from_file_location, module_from_spec\n"
            f" spec = spec_from_file_location('_amp_apex_finder', {str(finder_file)!r})\n"
            " module = sys.modules[spec.name] = module_from_spec(spec)\n"
            " spec.loader.exec_module(module)\n"
            " module.install()\n"
            "except Exception:\n"
            " pass\n")
    return f"import sys; exec({body!r})\n"


def _site_dir(args: argparse.Namespace) -> Path:
    if args.site is not None:
        return Path(args.site)
    if sys.flags.no_site:
        # Without site, a venv's interpreter reports its base Python's directories.
        raise SystemExit("python -S does not know this environment's site directory (and reads no "
                         ".pth file): run without -S, or pass --site DIR.")
    if args.user:
        return Path(site.getusersitepackages())
    return Path(sysconfig.get_path("purelib"))


def _processed_site_dirs() -> set[Path]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return {Path(d).resolve() for d in dirs}


def enable(site_dir: str | os.PathLike[str]) -> Path:
    """Write the ``.pth`` into ``site_dir``; return its path."""
    site_dir = Path(site_dir)
    if not site_dir.is_dir():
        raise SystemExit(f"{site_dir} is not a directory; pass --site DIR with an existing site directory.")
    pth = site_dir / PTH_NAME
    try:
        tmp = pth.with_suffix(".pth.tmp")
        tmp.write_text(_pth_line(_FINDER_FILE))
        os.replace(tmp, pth)  # a concurrent start-up never reads half a line
    except PermissionError:
        raise SystemExit(f"cannot write to {site_dir}: enable it for your user only with "
                         "`python -m amp.apex enable --user`, or pass --site DIR.") from None
    return pth


def disable(site_dir: str | os.PathLike[str]) -> bool:
    """Remove the ``.pth`` from ``site_dir``; return whether there was one."""
    pth = Path(site_dir) / PTH_NAME
    if not pth.exists():
        return False
    pth.unlink()
    return True


def status(site_dir: str | os.PathLike[str]) -> list[str]:
    """Lines describing the switch in ``site_dir`` and in this process."""
    pth = Path(site_dir) / PTH_NAME
    lines = []
    if pth.exists():
        line = pth.read_text()
        lines.append(f"apex drop-in: enabled ({pth})")
        if repr(str(_FINDER_FILE)) not in line:
            lines.append("  warning: it loads another amp than this one; run `python -m amp.apex "
                         "enable` again to point it here")
        if pth.parent.resolve() not in _processed_site_dirs():
            lines.append(f"  warning: {pth.parent} is not a site directory of {sys.executable}; "
                         "its .pth files are read only where it is one")
    else:
        lines.append(f"apex drop-in: disabled (no {PTH_NAME} in {site_dir})")
    if sys.flags.no_site:
        lines.append("  note: this interpreter runs with -S, which reads no .pth file")
    nvidia_apex = _apex_finder.nvidia_apex_spec()
    if nvidia_apex is None:
        lines.append("NVIDIA Apex: not installed; apex.* aliases: " + ", ".join(
            f"apex.{name} -> {target}" for name, target in
            {**_apex_finder.ALIASES, **_apex_finder.ALIASES_WITHOUT_NVIDIA_APEX}.items()))
    else:
        lines.append(f"NVIDIA Apex: {nvidia_apex.origin}; apex.* aliases where it ships no module "
                     "of that name: " + ", ".join(f"apex.{name} -> {target}"
                                                  for name, target in _apex_finder.ALIASES.items()))
    active = _apex_finder.installed_finder() is not None
    lines.append(f"this process: the finder is {'active' if active else 'not active'}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m amp.apex", description=(
        "Make `from apex import amp` (and apex.fp16_utils, apex.parallel, ...) resolve to amp in "
        "every new Python process of this environment."))
    parser.add_argument("command", choices=("enable", "disable", "status"))
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="the user site directory")
    where.add_argument("--site", metavar="DIR", help="this site directory (default: the environment's)")
    args = parser.parse_args(argv)
    site_dir = _site_dir(args)
    if args.command == "enable":
        print(f"apex drop-in enabled: wrote {enable(site_dir)}; new Python processes see it "
              "(`python -m amp.apex disable` undoes it)")
    elif args.command == "disable":
        removed = disable(site_dir)
        print(f"apex drop-in disabled: removed {site_dir / PTH_NAME}" if removed
              else f"apex drop-in was not enabled in {site_dir}; nothing to do")
    else:
        print("\n".join(status(site_dir)))


if __name__ == "__main__":
    main()
