"""Custom losses named by import path: `policy_loss = "my_pkg.losses:clipped_ratio"` (or "my_pkg.losses.clipped_ratio",
or "path/to/file.py:clipped_ratio"), and functions given to `Config(policy_loss=fn)` / `fleetrl.main(...,
policy_loss=fn)`, which are turned into such a path (`loss_import_path`) since the trainer, another process, imports
the loss by name.

The contract a loss implements is fleetrl.losses.contract (docs/losses.md). The trainer checks the loss at start
(`check_custom_loss`, through `resolve_loss_settings`): the import, that it is callable, its `takes_over`, and a
trial call on tiny tensors whose result must have the right shape and a gradient; each failure is a ValueError
naming `policy_loss`. The syntax check (`check_loss_path`) imports nothing, so config checks stay light.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from pathlib import Path
from typing import Any

from fleetrl.losses.settings import LOSS_NAMES, LossSettings

_IDENT = r"[A-Za-z_]\w*"
_COLON_PATH = re.compile(rf"^(?:{_IDENT}(?:\.{_IDENT})*|[^:]+\.py):{_IDENT}(?:\.{_IDENT})*$")
_DOTTED_PATH = re.compile(rf"^{_IDENT}(?:\.{_IDENT})+$")

TRIAL_SHAPE = (2, 3)
"""[B, T] of the trial call a custom loss gets at start."""


def is_loss_path(name: str) -> bool:
    """Whether `name` reads as an import path ("module:attr", "module.attr", "file.py:attr"), not a built-in."""
    return name not in LOSS_NAMES and bool(_COLON_PATH.match(name) or _DOTTED_PATH.match(name))


def check_loss_path(name: str) -> None:
    """Raise a ValueError naming `policy_loss` unless `name` is a built-in loss or reads as an import path."""
    if name in LOSS_NAMES or is_loss_path(name):
        return
    raise ValueError(
        f"policy_loss {name!r} is not one of {list(LOSS_NAMES)} (the built-in losses) nor an import path of a custom "
        "loss ('package.module:function', 'package.module.function' or 'path/to/file.py:function')"
    )


def _walk(obj: Any, attrs: str, spec: str, where: str) -> Any:
    """`obj.a.b` for attrs "a.b" ("" gives obj); a missing attribute is named."""
    for attr in filter(None, attrs.split(".")):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(f"policy_loss {spec!r}: {where} has no attribute {attr!r}") from None
    return obj


def _import(spec: str) -> Any:
    if ":" in spec:
        module_name, attrs = spec.rsplit(":", 1)
    else:
        module_name, attrs = spec.rsplit(".", 1)
    if module_name.endswith(".py"):
        from fleetrl.user_code import load_object

        first, _, rest = attrs.partition(".")
        try:
            obj = load_object(f"{module_name}:{first}")
        except Exception as exc:  # running the user's file may raise anything
            raise ValueError(f"policy_loss {spec!r}: cannot load it ({type(exc).__name__}: {exc})") from None
        return _walk(obj, rest, spec, first)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import error of user code is the run's bad setting
        raise ValueError(
            f"policy_loss {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); the trainer "
            "imports it from its working directory, the config's folder and PYTHONPATH"
        ) from None
    return _walk(module, attrs, spec, f"module {module_name!r}")


@functools.cache
def load_custom_loss(spec: str) -> Any:
    """The loss function an import path names (imported once per process); ValueError naming `policy_loss` when
    the import fails, the object is not callable or its `takes_over` is malformed."""
    from fleetrl.losses.contract import takes_over

    check_loss_path(spec)
    if spec in LOSS_NAMES:
        raise ValueError(f"policy_loss {spec!r} is a built-in loss, not an import path")
    fn = _import(spec)
    if not callable(fn):
        raise ValueError(
            f"policy_loss {spec!r} names a {type(fn).__name__}, not a function: a loss is called as "
            "loss(inputs: LossInputs, settings: LossSettings) -> TokenLoss"
        )
    try:
        takes_over(fn)
    except ValueError as exc:
        raise ValueError(f"policy_loss {spec!r}: {exc}") from None
    return fn


@functools.cache
def check_custom_loss(spec: str, settings: LossSettings) -> None:
    """Load the loss and call it once on tiny [2, 3] tensors through fleetrl's own path (sanitising, TIS,
    aggregation, metrics): a wrong return type or shape, an exception, a loss without gradient or a non-finite
    loss fails here, at start, as a ValueError naming `policy_loss`. Checked once per (spec, settings)."""
    import torch

    from fleetrl.losses.policy import compute_policy_loss

    fn = load_custom_loss(spec)
    b, t = TRIAL_SHAPE
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(b, t, generator=g, dtype=torch.float32) - 0.5
    logprobs = (old + 0.01 * torch.randn(b, t, generator=g)).requires_grad_(True)
    rollout = old + 0.01 * torch.randn(b, t, generator=g)
    ref = old + 0.01 * torch.randn(b, t, generator=g) if settings.kl_beta > 0 or settings.distill_weight > 0 else None
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    versions = torch.tensor([[0, 3, 3], [0, 2, 0]])
    advantages = torch.tensor([1.0, -1.0])
    try:
        loss, _ = compute_policy_loss(
            spec, fn, settings, logprobs, old, rollout, advantages, mask, ref_logprobs=ref, versions=versions
        )
    except Exception as exc:  # whatever the user's loss raises is reported, naming the field
        message = str(exc)
        if message.startswith(f"policy_loss {spec!r}"):
            raise ValueError(f"{message} (in a trial call on [{b}, {t}] tensors at start)") from None
        raise ValueError(
            f"policy_loss {spec!r}: a trial call on [{b}, {t}] tensors at start raised {type(exc).__name__}: {exc}"
        ) from exc
    if not loss.requires_grad:
        raise ValueError(
            f"policy_loss {spec!r}: its loss has no gradient with respect to inputs.logprobs (a trial call on "
            f"[{b}, {t}] tensors at start); the loss must be computed from inputs.logprobs"
        )
    if not bool(torch.isfinite(loss.detach())):
        raise ValueError(f"policy_loss {spec!r}: a trial call on [{b}, {t}] tensors at start gave loss {float(loss)}")


def loss_import_path(fn: Any) -> str:
    """The import path of a loss function given as a Python object, so the trainer process can import it: the
    function's module and name, or for a function of the script being run (`__main__`), that script's path.
    ValueError naming `policy_loss` for what no other process can import: a lambda, a closure, a function of a
    notebook, a bound method or any object without a module-level name."""
    label = getattr(fn, "__qualname__", None) or type(fn).__name__
    if not callable(fn):
        raise ValueError(
            f"policy_loss must be a loss name, an import path or a function, got a {type(fn).__name__}: {fn!r}"
        )
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or not hasattr(fn, "__name__"):
        raise ValueError(
            f"policy_loss: {label} has no module-level name; the trainer runs in another process and imports the "
            "loss by path, so give a function defined at module level (def my_loss(inputs, settings): ...)"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        kind = "a lambda" if "<lambda>" in qualname else "a function defined inside another function"
        raise ValueError(
            f"policy_loss: {module_name}.{qualname} is {kind}, which cannot reach the trainer process (it imports the "
            "loss by path); define it at module level of an importable module or of your script"
        )
    module = sys.modules.get(module_name)
    if module_name == "__main__":
        script = getattr(module, "__file__", None)
        if not script:
            raise ValueError(
                f"policy_loss: {qualname} is defined in an interactive session or notebook, which the trainer "
                "process cannot import; put it in a .py module and pass 'module:function' (or the function from it)"
            )
        spec = f"{Path(script).resolve()}:{qualname}"
    else:
        spec = f"{module_name}:{qualname}"
    if module is None or _walk(module, qualname, spec, f"module {module_name!r}") is not fn:
        raise ValueError(
            f"policy_loss: {module_name}.{qualname} is not what that name holds in its module (a decorated, "
            "replaced or dynamically made function?); the trainer imports the loss by path, so pass one it can find"
        )
    return spec
