"""Argument checks shared by the public entry points (no harts_hf imports, so every subpackage may use them).

Each error names the argument, the value received and what is expected; ``name`` carries the caller's prefix,
e.g. ``"tree_logprobs: temperature"``.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_bool", "check_int", "check_number", "trainer_args"]


def check_int(value, name: str, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``value`` as an ``int``: any integer (numpy's included) but a bool, at least ``minimum``; or None if allowed."""
    if value is None and allow_none:
        return None
    expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def check_number(value, name: str, *, allow_zero: bool = False) -> float:
    """``value`` as a ``float``: a finite real number (not a bool), > 0, or >= 0 with ``allow_zero``."""
    expected = "a finite number " + (">= 0" if allow_zero else "> 0")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def check_bool(value, name: str) -> bool:
    """``value`` if it is a bool (not a string or an int standing for one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} of type {type(value).__name__}")
    return value


def trainer_args(args, config_class: type, model, trainer: str, base: str):
    """A tree trainer's ``args``: ``config_class`` defaults named after the model when None; anything but a
    ``config_class`` (e.g. TRL's own config, ``base``) is refused naming the class it needs."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        return config_class(f"{name.split('/')[-1]}-{trainer.removesuffix('Trainer')}")
    if not isinstance(args, config_class):
        raise TypeError(f"args is a {type(args).__name__}; {trainer} needs a {config_class.__name__} (it has every "
                        f"{base} field plus the tree switches).")
    return args
