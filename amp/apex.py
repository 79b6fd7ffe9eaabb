"""``python -m amp.apex enable | disable | status``: the opt-in switch for Apex-era code.

``enable`` writes one file of ours, ``amp-apex-dropin.pth``, into this environment's
site-packages (or ``--user``'s, or ``--site DIR``). Python runs its one line at every start-up
(torchrun workers, spawned processes and libraries' probes included): it loads
``amp/_apex_finder.py`` by path and puts its finder first on ``sys.meta_path``, so that
``from apex import amp`` and every other Apex-era import resolve to this package wherever the
installed NVIDIA Apex (if any) ships no module of that name (see that module for the rule). The
line fails soft: if amp is removed or moved it does nothing. ``disable`` removes the file; no
other distribution's files are touched.

Where amp is an installed distribution, ``enable`` also lists the file in amp's own ``RECORD``, so
``pip uninstall`` removes it with amp (an upgrade too: enable again after one); a later install
never finds the switch on by surprise. Run from a source tree, nothing records it: ``disable``
before deleting the tree. Processes already running are not affected either way.

``python -S`` (no ``site``) processes no ``.pth`` file, so the switch does not reach it; ``python
-I`` and ``-s`` skip the user site, which ``--user`` writes to.
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import site
import stat
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Sequence

from . import _apex_finder

__all__ = ["PTH_NAME", "APEX_ERA_MODULES", "enable", "disable", "status", "main"]

PTH_NAME = "amp-apex-dropin.pth"
_FINDER_FILE = Path(_apex_finder.__file__).resolve()

#: Every module path Apex-era code imports, as of Apex e13873de (the last Apex with ``amp``),
#: with the packages Apex still ships by their top only; and Apex's two extensions.
APEX_ERA_MODULES = (
    "apex",
    "apex.amp", "apex.amp.__version__", "apex.amp._amp_state", "apex.amp._initialize",
    "apex.amp._process_optimizer", "apex.amp.amp", "apex.amp.compat", "apex.amp.frontend",
    "apex.amp.handle", "apex.amp.lists", "apex.amp.lists.functional_overrides",
    "apex.amp.lists.tensor_overrides", "apex.amp.lists.torch_overrides", "apex.amp.opt",
    "apex.amp.rnn_compat", "apex.amp.scaler", "apex.amp.utils", "apex.amp.wrap",
    "apex.fp16_utils", "apex.fp16_utils.fp16_optimizer", "apex.fp16_utils.fp16util",
    "apex.fp16_utils.loss_scaler",
    "apex.parallel", "apex.parallel.LARC", "apex.parallel.distributed",
    "apex.parallel.sync_batchnorm", "apex.parallel.optimized_sync_batchnorm",
    "apex.parallel.multiproc", "apex.parallel.sync_batchnorm_kernel",
    "apex.parallel.optimized_sync_batchnorm_kernel",
    "apex.multi_tensor_apply", "apex.multi_tensor_apply.multi_tensor_apply",
    "apex.optimizers", "apex.optimizers.fused_sgd", "apex.optimizers.fused_adam",
    "apex.optimizers.fused_lamb", "apex.optimizers.fused_adagrad", "apex.optimizers.fused_novograd",
    "apex.optimizers.fused_mixed_precision_lamb",
    "apex.normalization", "apex.normalization.fused_layer_norm",
    "apex.contrib", "apex.mlp", "apex.fused_dense", "apex.transformer", "apex.RNN",
    "amp_C", "apex_C",
)


def _pth_line(finder_file: Path) -> str:
    # One line (site.py executes lines that start with "import"), failing soft: a missing or
    # broken amp must never break Python's start-up. importlib.machinery only, no importlib.util:
    # every process of the environment pays for what this line imports.
    body = ("try:\n"
            " from importlib.machinery import SourceFileLoader\n"
            f" loader = SourceFileLoader('_amp_apex_finder', {str(finder_file)!r})\n"
            " module = sys.modules[loader.name] = type(sys)(loader.name)\n"
            " module.__file__, module.__loader__ = loader.path, loader\n"
            " loader.exec_module(module)\n"
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
        if site.ENABLE_USER_SITE is False and not sys.flags.no_user_site:
            raise SystemExit("this virtual environment does not read the user site directory "
                             "(as pip says of --user installs): run without --user.")
        return Path(site.getusersitepackages())
    return Path(sysconfig.get_path("purelib"))


def _processed_site_dirs() -> set[Path]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return {Path(d).resolve() for d in dirs}


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a concurrent reader (a Python start-up, another
    ``enable``) sees the old file or the new one, never a part. The temporary name is unique, so
    concurrent writers never share one; it is removed whatever fails. The file keeps its mode, or
    gets a new file's usual one (readable by every user of the environment)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as file:
            file.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _own_record() -> Path | None:
    """The ``RECORD`` of the installed distribution that holds this amp (a regular or an editable
    install), or None where amp runs from a source tree."""
    import importlib.metadata
    import json
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    root = _FINDER_FILE.parent.parent
    for dist in importlib.metadata.distributions():
        record_text = dist.read_text("RECORD") or ""
        if "amp/_apex_finder.py" in record_text:
            holds_us = any(str(f).replace("\\", "/").endswith("amp/_apex_finder.py")
                           and Path(str(dist.locate_file(f))).resolve() == _FINDER_FILE
                           for f in dist.files or ())
        else:
            url = json.loads(dist.read_text("direct_url.json") or "{}")
            holds_us = (url.get("dir_info", {}).get("editable", False)
                        and Path(url2pathname(urlparse(url.get("url", "")).path)).resolve() == root)
        if holds_us:
            return next((Path(str(dist.locate_file(f))) for f in dist.files or ()
                         if f.name == "RECORD" and f.parent.name.endswith(".dist-info")), None)
    return None


def _record_entry(record: Path, pth: Path) -> str:
    """How ``record`` names ``pth``: relative to the directory that holds the ``.dist-info``."""
    try:
        return os.path.relpath(pth, record.parent.parent).replace(os.sep, "/")
    except ValueError:  # another drive (Windows)
        return str(pth)


def _record_rows(record: Path, pth: Path, line: str | None) -> list[list[str]]:
    """``record``'s rows without ``pth``'s, plus a row for ``pth`` holding ``line`` (if given)."""
    entry = _record_entry(record, pth)
    rows = [row for row in csv.reader(io.StringIO(record.read_text())) if row and row[0] != entry]
    if line is not None:
        data = line.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append([entry, f"sha256={digest}", str(len(data))])
    return rows


def _update_record(record: Path | None, pth: Path, line: str | None) -> str:
    """List ``pth`` in amp's ``RECORD`` (``line`` given) or take it out; what that means, in words."""
    if record is None:
        return ("amp runs from a source tree here (no installed distribution holds it): run "
                "`python -m amp.apex disable` before deleting the tree")
    try:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(_record_rows(record, pth, line))
        _write_atomically(record, out.getvalue())
    except OSError as error:
        return (f"could not update amp's install record {record} ({error.strerror or error}): "
                "`pip uninstall` will not know the file; run `python -m amp.apex disable` first")
    if line is None:
        return f"taken out of amp's install record {record}"
    return f"listed in amp's install record {record}: `pip uninstall` removes it with amp"


def _recorded(record: Path | None, pth: Path) -> bool:
    if record is None or not record.is_file():
        return False
    entry = _record_entry(record, pth)
    return any(row and row[0] == entry for row in csv.reader(io.StringIO(record.read_text())))


def enable(site_dir: str | os.PathLike[str], *, create: bool = False) -> tuple[Path, str]:
    """Write the ``.pth`` into ``site_dir`` (created first with ``create``, as ``pip install
    --user`` creates the user site); return its path and what became of amp's install record."""
    site_dir = Path(site_dir)
    if create:
        try:
            site_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SystemExit(f"cannot create {site_dir}: {error.strerror or error}") from None
    if not site_dir.is_dir():
        raise SystemExit(f"{site_dir} is not a directory; pass --site DIR with an existing site directory.")
    pth = site_dir / PTH_NAME
    line = _pth_line(_FINDER_FILE)
    if pth.is_dir():
        raise SystemExit(f"{pth} is a directory, not amp's file: remove it (or pass --site DIR) and "
                         "enable again.")
    try:
        _write_atomically(pth, line)
    except PermissionError:
        raise SystemExit(f"cannot write to {site_dir}: enable it for your user only with "
                         "`python -m amp.apex enable --user`, or pass --site DIR.") from None
    except OSError as error:
        raise SystemExit(f"cannot write {pth}: {error.strerror or error}; nothing was changed.") from None
    return pth, _update_record(_own_record(), pth, line)


def disable(site_dir: str | os.PathLike[str]) -> tuple[bool, str]:
    """Remove the ``.pth`` from ``site_dir``; return whether there was one, and what became of
    amp's install record."""
    pth = Path(site_dir) / PTH_NAME
    if not pth.exists():
        return False, ""
    try:
        pth.unlink()
    except PermissionError:
        raise SystemExit(f"cannot remove {pth}: no permission to write to {pth.parent}; run it as "
                         "the user who enabled it (`--user` for your user site).") from None
    except OSError as error:
        raise SystemExit(f"cannot remove {pth}: {error.strerror or error}") from None
    record = _own_record()
    return True, _update_record(record, pth, None) if _recorded(record, pth) else ""


def _origin(finder: _apex_finder.ApexAliasFinder, name: str) -> str:
    try:
        target = finder.target(name)
    except Exception as error:  # a package of ours that fails to import: say so, list the rest
        return f"error: {type(error).__name__}: {error}"
    if target is not None:
        return f"amp: {target}"
    spec = _apex_finder.find(name)
    if spec is None:
        return "missing"
    return f"{'installed' if name in _apex_finder.EXTENSIONS else 'NVIDIA Apex'}: {spec.origin}"


def status(site_dir: str | os.PathLike[str]) -> list[str]:
    """Lines describing the switch in ``site_dir``, in this process, and what answers each
    Apex-era module path here."""
    pth = Path(site_dir) / PTH_NAME
    lines = []
    enabled = pth.is_file()
    if enabled:
        lines.append(f"apex drop-in: enabled ({pth}); new Python processes of this environment "
                     "resolve the module paths below as listed")
        if repr(str(_FINDER_FILE)) not in pth.read_text():
            lines.append("  warning: it loads another amp than this one; run `python -m amp.apex "
                         "enable` again to point it here")
        if pth.parent.resolve() not in _processed_site_dirs():
            lines.append(f"  warning: {pth.parent} is not a site directory of {sys.executable}; "
                         "its .pth files are read only where it is one")
        record = _own_record()
        if _recorded(record, pth):
            lines.append(f"  listed in amp's install record {record}: `pip uninstall` removes it")
        else:
            lines.append("  not in amp's install record: `pip uninstall` leaves it; run "
                         "`python -m amp.apex disable` first")
    else:
        lines.append(f"apex drop-in: disabled (no {PTH_NAME} in {site_dir}); no apex module "
                     "resolves to amp in new processes")
    if sys.flags.no_site:
        lines.append("  note: this interpreter runs with -S, which reads no .pth file")
    apex_spec = _apex_finder.nvidia_apex_spec()
    lines.append("NVIDIA Apex: " + ("not installed" if apex_spec is None else
                                    f"{apex_spec.origin} (what it ships stays its own)"))
    active = _apex_finder.installed_finder() is not None
    lines.append(f"this process: the finder is {'active' if active else 'not active'}")
    lines.append("module paths, " + ("as new processes resolve them:" if enabled else
                                     "as they would resolve with `python -m amp.apex enable`:"))
    finder = _apex_finder.ApexAliasFinder()
    width = max(map(len, APEX_ERA_MODULES))
    lines.extend(f"  {name:<{width}}  {_origin(finder, name)}" for name in APEX_ERA_MODULES)
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
        pth, record = enable(site_dir, create=args.user)
        print(f"apex drop-in enabled: wrote {pth}; new Python processes see it "
              f"(`python -m amp.apex disable` undoes it)\n  {record}")
    elif args.command == "disable":
        removed, record = disable(site_dir)
        print(f"apex drop-in disabled: removed {site_dir / PTH_NAME}" + (f"\n  {record}" if record else "")
              if removed else f"apex drop-in was not enabled in {site_dir}; nothing to do")
    else:
        print("\n".join(status(site_dir)))


if __name__ == "__main__":
    main()
