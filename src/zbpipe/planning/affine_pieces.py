"""The points between which a convex piecewise-affine function of one number is affine.

Why: a plan with a fixed order, simulated on costs that grow affinely with one number ``s``
(the head's cost scale, :func:`zbpipe.planning.split.choose_split`), has a step time that is
the longest path through its actions: a maximum of affine functions of ``s``, hence convex and
piecewise affine. On an interval where the baseline's step time ``t_b`` is affine and a
candidate's ``t_c`` is convex, ``t_c - t_b`` is convex and ``t_c / t_b`` quasi-convex: both are
largest at the interval's ends. So a candidate no slower than the baseline at the points
:func:`affine_pieces` returns is no slower anywhere between ``lo`` and ``hi``, and its worst
ratio over the interval is its worst ratio at those points.

The search is the sandwich method: the tangents at both ends of an interval meet at the kink
when there is one; otherwise the interval is cut there and each half searched again.
"""

from __future__ import annotations

from collections.abc import Callable

#: relative tolerance for "on the line" (the simulator sums floats: rounding, not kinks)
REL = 1e-9


def _close(u: float, v: float) -> bool:
    return abs(u - v) <= REL * max(1.0, abs(u), abs(v))


def affine_pieces(
    fn: Callable[[float], float], lo: float, hi: float, *, max_points: int = 24
) -> tuple[float, ...]:
    """Sorted points ``lo = x0 < x1 < ... < xn = hi`` such that the convex piecewise-affine
    ``fn`` is affine on each ``[x_i, x_i+1]``; at most ``max_points`` of them (past that, the
    remaining intervals are cut at their tangents' meeting point without checking: a bound on
    work for a function with more kinks than expected or one that is not convex)."""
    if not lo <= hi:
        raise ValueError(f"affine_pieces: need lo <= hi, got {lo}, {hi}")
    if hi == lo:
        return (lo,)
    memo: dict[float, float] = {}

    def f(x: float) -> float:
        if x not in memo:
            memo[x] = fn(x)
        return memo[x]

    step = (hi - lo) * 1e-6  # finite differences: exact on an affine piece longer than this
    points = {lo, hi}
    todo = [(lo, hi)]
    while todo and len(points) < max_points:
        a, b = todo.pop()
        fa, fb = f(a), f(b)
        if _close(f((a + b) / 2), (fa + fb) / 2):
            continue  # convex and touching its chord inside: affine on [a, b]
        sa = (f(a + step) - fa) / step
        sb = (fb - f(b - step)) / step
        x = (fb - fa + sa * a - sb * b) / (sa - sb) if sb > sa else (a + b) / 2
        if not a < x < b:
            x = (a + b) / 2
        points.add(x)
        if _close(f(x), fa + sa * (x - a)):
            continue  # fn = max of the two tangents on [a, b]: one kink, at x
        todo += [(a, x), (x, b)]
    return tuple(sorted(points))
