"""``python -m apex.parallel.multiproc script.py ARGS``: Apex's launcher, one process per rank.

As Apex's: the world size is ``--world-size N`` if ARGS hold it, else the number of visible GPUs
(and ``--world-size`` is appended); each process runs ``python script.py ARGS --rank i`` (``--rank``
replaced if given); rank 0 writes to this terminal, rank i to ``GPU_i.log``. Unlike Apex's, it
fails as a whole: when one process fails the others are stopped, and the launcher exits with that
process's status (Apex's waited on the others, which may wait forever on the missing rank).
torchrun is the maintained launcher: ``torchrun --nproc_per_node=N script.py ARGS``, with the script
reading ``LOCAL_RANK`` / ``RANK`` / ``WORLD_SIZE`` from the environment.
"""
from __future__ import annotations

import subprocess
import sys
import time
from typing import IO, Sequence

import torch

__all__ = ["main"]

_USAGE = ("usage: python -m apex.parallel.multiproc script.py [ARGS] [--world-size N]\n"
          "(or, the maintained launcher: torchrun --nproc_per_node=N script.py [ARGS])")


def _with_option(args: list[str], option: str, value: int) -> list[str]:
    if option in args:
        index = args.index(option)
        if index + 1 == len(args):
            raise SystemExit(f"apex.parallel.multiproc: {option} needs a value\n{_USAGE}")
        return args[:index + 1] + [str(value)] + args[index + 2:]
    return args + [option, str(value)]


def _world_size(args: list[str]) -> int:
    if "--world-size" not in args:
        return torch.cuda.device_count()
    index = args.index("--world-size")
    text = args[index + 1] if index + 1 < len(args) else ""
    if not text.isdigit():
        raise SystemExit(f"apex.parallel.multiproc: --world-size needs a number of processes, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the processes, wait for them; the exit status of the job."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    world_size = _world_size(args)
    if world_size < 1:
        raise SystemExit("apex.parallel.multiproc: no GPU is visible, so the number of processes is "
                         "unknown: pass --world-size N (e.g. for gloo on CPU), or launch with "
                         f"torchrun --nproc_per_node=N {' '.join(args)}")
    args = _with_option(args, "--world-size", world_size)
    workers: list[subprocess.Popen[bytes]] = []
    logs: list[IO[str]] = []
    try:
        for rank in range(world_size):
            command = [sys.executable] + _with_option(args, "--rank", rank)
            print(f"apex.parallel.multiproc: rank {rank}: {' '.join(command)}", flush=True)
            log: IO[str] | None = None if rank == 0 else open(f"GPU_{rank}.log", "w")
            if log is not None:
                logs.append(log)
            workers.append(subprocess.Popen(command, stdout=log))
        return _wait(workers)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for log in logs:
            log.close()


def _wait(workers: list[subprocess.Popen[bytes]]) -> int:
    """0 when every process succeeds; else the first failure's status (the others are stopped)."""
    while True:
        codes = [worker.poll() for worker in workers]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None:
            failed_rank = codes.index(failed)
            print(f"apex.parallel.multiproc: rank {failed_rank} exited with status {failed}; "
                  "stopping the other ranks", file=sys.stderr, flush=True)
            return failed if failed > 0 else 128 - failed  # killed by a signal: the shell's 128 + N
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
