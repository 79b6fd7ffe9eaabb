"""The options of one ``amp.initialize`` call: the opt-level presets and the user's checked overrides.

The opt-level table below is the single source of truth for what each preset means. A run keeps
its options as one :class:`Options` (``AmpContext.options``; Apex's ``_amp_state.opt_properties``),
made by :meth:`Options.for_level`, checked there once, and never changed afterwards.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import torch

from ._apex_compat import warn_or_err

__all__ = ["OPT_LEVELS", "OptLevel", "Options", "REMAINDER", "check_bool", "check_option", "patch_type_of"]

CAST_MODEL_TYPES = (torch.float16, torch.bfloat16, torch.float32)


class OptLevel(NamedTuple):
    """One preset: what it does, the dtype O1/O4 patch torch functions to, and its options."""

    brief: str
    patch_type: torch.dtype | None
    options: dict[str, Any]


# Every preset also sets enabled=True and opt_level.
OPT_LEVELS = {
    "O0": OptLevel("Pure FP32 training.", None, dict(
        cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
        master_weights=False, loss_scale=1.0)),
    "O1": OptLevel("Insert automatic casts around PyTorch functions and Tensor methods (FP16).",
                   torch.float16, dict(
        cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
        master_weights=None, loss_scale="dynamic")),
    "O2": OptLevel("FP16 training with FP32 batchnorm and FP32 master weights.", None, dict(
        cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=True,
        master_weights=True, loss_scale="dynamic")),
    "O3": OptLevel("Pure FP16 training.", None, dict(
        cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=False,
        master_weights=False, loss_scale=1.0)),
    "O4": OptLevel("Insert automatic casts around PyTorch functions and Tensor methods (BF16).",
                   torch.bfloat16, dict(
        cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
        master_weights=None, loss_scale=1.0)),
    "O5": OptLevel("BF16 training with FP32 batchnorm and FP32 master weights.", None, dict(
        cast_model_type=torch.bfloat16, patch_torch_functions=False, keep_batchnorm_fp32=True,
        master_weights=True, loss_scale=1.0)),
}


# master_weights=REMAINDER: bf16 weights plus remainders in place of fp32 masters (bf16 models only).
REMAINDER = "remainder"


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}"
                        + (" (a string, not a bool)." if isinstance(value, str) else "."))


def patch_type_of(opt_level: str | None, patch_torch_functions: bool) -> torch.dtype | None:
    """The low-precision dtype O1/O4 casts to, or None when functions are not patched."""
    level = OPT_LEVELS.get(opt_level) if opt_level is not None else None
    return level.patch_type if level is not None and patch_torch_functions else None


def check_option(opt_level: str | None, name: str, value: Any, lenient: bool) -> Any:
    """``value`` as option ``name`` of ``opt_level`` holds it (``"True"`` becomes True, ``"128"`` 128.0).

    A value of the wrong kind raises. One that does not fit the level (master weights with O1)
    raises ``RuntimeError``, or, when ``lenient`` (Apex's ``hard_override``), only warns.
    ``enabled`` and ``opt_level`` themselves are taken as they are.
    """
    level = OPT_LEVELS.get(opt_level) if opt_level is not None else None
    patching_level = level is not None and level.patch_type is not None
    if name == "cast_model_type":
        if patching_level and value not in (None, False, torch.float32):
            warn_or_err(f"{opt_level} inserts casts around Torch functions rather than "
                        f"casting model weights, so with {opt_level} cast_model_type should "
                        "be None (or torch.float32); use O2/O5 to cast the model.", lenient)
        if value not in (None, False) and value not in CAST_MODEL_TYPES:
            raise TypeError("cast_model_type must be torch.float16, torch.bfloat16, "
                            f"torch.float32, None or False, got {value!r}.")
    elif name == "patch_torch_functions":
        check_bool("patch_torch_functions", value)
        if value and not patching_level:
            warn_or_err("Currently, patch_torch_functions=True should only be set by selecting "
                        "opt_level='O1' (or 'O4' for bfloat16).", lenient)
    elif name == "keep_batchnorm_fp32":
        if patching_level and value is not None:
            warn_or_err(f"With opt_level {opt_level}, batchnorm functions are automatically "
                        "patched to run in FP32, so keep_batchnorm_fp32 should be None.", lenient)
        if value in ("True", "False"):
            value = value == "True"
        if value not in (True, False, None):
            raise ValueError("keep_batchnorm_fp32 must be True, False, None, 'True' or 'False', "
                             f"got {value!r}.")
    elif name == "master_weights":
        if value is not None and value != REMAINDER and not isinstance(value, bool):
            raise TypeError(f"master_weights must be True, False, None or {REMAINDER!r}, got {value!r}.")
        if patching_level and value is not None:
            warn_or_err(f"It doesn't make sense to use master_weights with {opt_level}: with "
                        f"{opt_level} your model weights themselves should be FP32.", lenient)
    elif name == "loss_scale":
        if isinstance(value, bool):
            raise TypeError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}; "
                            "a bool is not a loss scale.")
        if value != "dynamic":
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}.")
            if not value > 0 or value == float("inf"):
                raise ValueError(f"loss_scale must be a positive finite number, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of one run: an opt level's preset with the user's overrides, each checked.

    ``lenient`` is Apex's ``hard_override``: an override that does not fit the level warns
    instead of raising. The defaults are a disabled run's (``amp.initialize(enabled=False)``).
    """

    enabled: bool = False
    opt_level: str | None = None
    cast_model_type: torch.dtype | bool | None = None  # False: no cast, as None
    patch_torch_functions: bool = False
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | str | None = None  # True, False, None or REMAINDER
    loss_scale: float | str = 1.0
    lenient: dataclasses.InitVar[bool] = False

    def __post_init__(self, lenient: bool) -> None:
        for field in dataclasses.fields(self):
            value = check_option(self.opt_level, field.name, getattr(self, field.name), lenient)
            object.__setattr__(self, field.name, value)
        if self.master_weights == REMAINDER and self.cast_model_type is not torch.bfloat16:
            cast = "no cast" if self.cast_model_type in (None, False) else self.cast_model_type
            raise ValueError(
                f"master_weights='remainder' keeps each fp32 master as its bfloat16 model weight plus the "
                f"low 16 bits, so the model must be cast to torch.bfloat16, but {self.opt_level} with "
                f"these options has {cast}. Use opt_level='O5' (or cast_model_type=torch.bfloat16); "
                "fp16 values are not truncated fp32 values, so fp16 models keep master_weights=True.")

    @classmethod
    def for_level(cls, opt_level: str, overrides: Mapping[str, Any], lenient: bool = False) -> Options:
        """``opt_level``'s preset with the non-None ``overrides`` applied (checked, in field order)."""
        chosen = {key: value for key, value in overrides.items() if value is not None}
        return cls(True, opt_level, **{**OPT_LEVELS[opt_level].options, **chosen}, lenient=lenient)

    @property
    def options(self) -> dict[str, Any]:
        """Every option by name, in Apex's order (what ``initialize`` prints)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @property
    def patch_torch_functions_type(self) -> torch.dtype | None:
        """The low-precision dtype O1/O4 casts to, or None when functions are not patched."""
        return patch_type_of(self.opt_level, self.patch_torch_functions)
