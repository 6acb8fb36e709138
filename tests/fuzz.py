"""What every fuzz test of an entry accepts: a correct result, or a :class:`TrajInputError` that names its field."""

from __future__ import annotations

from typing import Any, Callable

from verl_traj.core import TrajInputError

NAN, INF = float("nan"), float("inf")


def refused(err: BaseException) -> None:
    """The one accepted failure: a TrajInputError that names its field."""
    assert isinstance(err, TrajInputError), f"{type(err).__name__}: {err}"
    assert err.field, f"no field on: {err}"
    assert err.field in str(err), (err.field, str(err))


def run(fn: Callable, expect: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; ``expect`` "refuse": must raise a named TrajInputError; "ok": must not raise;
    "any": either. Returns the result, or None when refused."""
    try:
        out = fn(*args, **kwargs)
    except TrajInputError as err:
        refused(err)
        assert expect != "ok", f"refused a harmless input: {err}"
        return None
    assert expect != "refuse", "a harmful corruption was accepted silently"
    return out
