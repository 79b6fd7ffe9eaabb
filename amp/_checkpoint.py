"""``amp.state_dict`` / ``amp.load_state_dict``: the loss scalers of the ``initialize`` runs in use.

The runs in use are decided by what the program did (``_amp_state.checkpoint_runs``): the latest
``initialize`` call's run, the runs initialized with it, and those that stepped since it, as long
as the program references their models. With none in use, the latest run is saved, as Apex saved
the latest call's scalers, where no other run stepped since its ``initialize``; else the save is
refused as ambiguous. One run in use saves Apex's format, ``{"loss_scaler0":
{...}, "loss_scaler1": ...}``, so single-run checkpoints are as they always were; several save one
such dict per run, ``{"run0": ..., "run1": ...}``, in the order of their ``initialize`` calls.

A load goes to the runs in use, matched by that position, or, where their number differs from the
checkpoint's, to those of them that have not stepped since their ``initialize`` (Apex's recipe in
one process: a new run made to resume the saved one while the saved one is still referenced). It
refuses, before anything changes, a checkpoint that neither matches in number of runs, or whose
``num_losses`` or static / dynamic scalers differ from its targets'. ``optimizer=`` selects one
run (``run``, here), in Apex's format.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from ._amp_state import _amp_state
from ._run import AmpContext

RUN_PREFIX = "run"


def _scaler_key(index):
    return f"loss_scaler{index}"


def _run_key(index):
    return f"{RUN_PREFIX}{index}"


def _scaler_states(context, destination):
    for index, scaler in enumerate(context.loss_scalers):
        destination[_scaler_key(index)] = scaler.state_dict()
    return destination


def state_dict(destination: dict[str, Any] | None = None, run: AmpContext | None = None) -> dict[str, Any]:
    if destination is None:
        destination = OrderedDict()
    if run is not None:
        return _scaler_states(run, destination)
    runs = _amp_state.checkpoint_runs()
    if not runs and _amp_state.context is not None and _amp_state.context.enabled:
        sole = _amp_state.sole_gone_run()
        if sole is None:
            raise RuntimeError(
                "amp.state_dict() found no amp.initialize run in use (the program references none of "
                "the models they returned), and runs other than the latest one stepped after it was "
                "initialized, so which run to save is ambiguous: save while the model you train is "
                "still referenced, or pass optimizer=that_runs_optimizer.")
        runs = [sole]  # its models are gone, but its scalers are what Apex would have saved
    if len(runs) == 1:
        return _scaler_states(runs[0], destination)
    for index, context in enumerate(runs):
        destination[_run_key(index)] = _scaler_states(context, OrderedDict())
    return destination


def _is_multi_run(state):
    return len(state) > 0 and all(isinstance(key, str) and key.startswith(RUN_PREFIX) for key in state)


def _kinds(flags):
    """``[True, None]`` -> ``"dynamic, ?"``: what a run's scalers are (None: not saved, Apex's dicts)."""
    return ", ".join({True: "dynamic", False: "static"}.get(flag, "?") for flag in flags)


def _describe_saved(state):
    entries = state.values() if _is_multi_run(state) else [state]
    described = []
    for entry in entries:
        if not isinstance(entry, dict):
            described.append(f"<{type(entry).__name__}>")
            continue
        flags = [value.get("dynamic") if isinstance(value, dict) else None for value in entry.values()]
        described.append(f"{len(entry)} loss scaler(s) ({_kinds(flags)})")
    return f"{len(described)} run(s): " + "; ".join(described)


def _describe_live(runs):
    described = [f"{context.options.opt_level} with {len(context.loss_scalers)} loss scaler(s) "
                 f"({_kinds(s.dynamic for s in context.loss_scalers)})"
                 f"{', stepped' if context.stepped else ''}" for context in runs]
    return f"{len(described)} run(s): " + "; ".join(described)


def _mismatch(state, runs, why):
    return RuntimeError(
        f"amp.load_state_dict refused the checkpoint, nothing was changed: {why} The checkpoint "
        f"holds {_describe_saved(state)}. amp.initialize runs in use, in call order: "
        f"{_describe_live(runs)}. Initialize the same runs (opt level, num_losses, loss_scale) in "
        "the same order as the saved process and load before they step, drop the objects of runs "
        "you no longer train, or load one run's entry with amp.load_state_dict(entry, "
        "optimizer=that_runs_optimizer). If you changed the opt level on purpose (O2 to O5, the usual "
        "remedy for fp16 overflows: bf16 has no loss scaler state to restore), skip "
        "amp.load_state_dict: model.load_state_dict and optimizer.load_state_dict restore the weights "
        "and the optimizer state.")


def _targets(runs, count):
    """The runs that a checkpoint of ``count`` runs loads into, or None where that is ambiguous."""
    if len(runs) == count:
        return runs
    fresh = [context for context in runs if not context.stepped]
    return fresh if len(fresh) == count else None


def _check_run(entry, context, state, runs, name):
    """Refuse an entry whose scalers do not match ``context``'s in number and kind."""
    if not isinstance(entry, dict):
        raise TypeError(f"amp.load_state_dict expects the dict from amp.state_dict(), got "
                        f"{type(entry).__name__} for {name}.")
    scalers = context.loss_scalers
    expected = {_scaler_key(index) for index in range(len(scalers))}
    unexpected = sorted(set(entry) - expected)
    missing = sorted(expected - set(entry))
    if unexpected or missing:
        raise _mismatch(state, runs, f"{name} has unexpected keys {unexpected} and missing keys "
                        f"{missing}: it was saved with num_losses={len(entry)}, the run it would "
                        f"load into has num_losses={len(scalers)}; use the same num_losses as the "
                        "saved run.")
    for index, scaler in enumerate(scalers):
        saved = entry[_scaler_key(index)]
        if isinstance(saved, dict) and saved.get("dynamic", scaler.dynamic) != scaler.dynamic:
            raise _mismatch(state, runs, f"{name}'s loss scaler {index} was saved "
                            f"{_kinds([saved.get('dynamic')])} but the live one is "
                            f"{_kinds([scaler.dynamic])}.")


def load_state_dict(state_dict: dict[str, Any], run: AmpContext | None = None) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"amp.load_state_dict expects the dict from amp.state_dict(), got "
                        f"{type(state_dict).__name__}.")
    runs = [run] if run is not None else _amp_state.checkpoint_runs()
    entries: list[Any]  # the saved runs' dicts, unchecked yet
    targets: list[AmpContext] | None  # the runs they load into, in order
    if not runs:
        raise RuntimeError("amp.load_state_dict() needs the loss scalers that amp.initialize creates, "
                           "and no run is in use (none was initialized, or the program no longer "
                           "references the models of those that were): call amp.initialize first, keep "
                           "what it returns, then load the checkpoint.")
    if _is_multi_run(state_dict):
        if run is not None:
            raise _mismatch(state_dict, runs, "optimizer= selects one run, and the checkpoint holds "
                            "several: pass one run's entry, e.g. state_dict['run1'].")
        entries = [state_dict.get(_run_key(index)) for index in range(len(state_dict))]
        targets = _targets(runs, len(entries))
        if targets is None or any(entry is None for entry in entries):
            raise _mismatch(state_dict, runs, f"the checkpoint's runs do not match the {len(runs)} "
                            "run(s) in use one to one, nor the ones of them that have not stepped.")
    else:
        targets = _targets(runs, 1)
        if targets is None:
            raise _mismatch(state_dict, runs, f"the checkpoint holds one run's loss scalers and "
                            f"{len(runs)} runs are in use, none or several of them not stepped yet, "
                            "so which one it belongs to is ambiguous.")
        entries = [state_dict]
    names = [_run_key(index) if len(entries) > 1 else "the checkpoint" for index in range(len(entries))]
    for entry, context, name in zip(entries, targets, names):
        _check_run(entry, context, state_dict, runs, name)
    # Dry run on copies first, so one bad entry leaves every scaler of every run untouched.
    for entry, context in zip(entries, targets):
        for index, scaler in enumerate(context.loss_scalers):
            copy.deepcopy(scaler).load_state_dict(entry[_scaler_key(index)])
    for entry, context in zip(entries, targets):
        for index, scaler in enumerate(context.loss_scalers):
            scaler.load_state_dict(entry[_scaler_key(index)])
