"""The math of the numba kernels: one element's step, and loops over a run of elements that stays in
one row of V's view and of M's (these vectorize). Each is the line-by-line counterpart of
:func:`smmf.functional._factored_update` (tests/test_fused_kernels.py ties them). ``sc`` is the step's
:class:`~smmf.kernels.numba_cpu.structs.Scalars`.

The 1-bit magnitude flag (magnitude_bits=1): F = [|M| > r cᵀ] needs the *new* factors of |M|, which
need every row's |M|: a first pass steps the weights and sums |M| and V, then a second pass forms M
again (same arithmetic, same inputs) and writes S and F. See
:func:`smmf.functional.store_magnitude_flag_`.
"""

from __future__ import annotations

import math
from typing import Any

import numba

from .cache import FASTMATH

_MATH: dict[str, Any] = dict(fastmath=FASTMATH, error_model="numpy", inline="always")


@numba.njit
def count_bad(grow, big):
    """NaN/inf elements of a row (rare: the vectorized loop only flags that there are some)."""
    bad = 0
    for j in range(grow.shape[0]):
        bad += 0 if abs(grow[j]) <= big else 1
    return bad


@numba.njit(inline="always")
def capped(x, cap):
    """``x`` at most ``cap`` (NaN stays NaN): what one element adds to a factor sum."""
    return cap if x > cap else x


@numba.njit(inline="always")
def finite_or_cap(x, cap):
    """NaN → 0, above ``cap`` → ``cap`` (:func:`smmf.functional.magnitude_flag_fit`)."""
    return cap - cap if x != x else (cap if x > cap else x)


@numba.njit(**_MATH)
def element(w, g, col_v, rv, sc, keep_bad, zero, l2_decay):
    """One element's decayed weight, prepared gradient and this step's V; and whether the raw
    gradient was finite (NaN/inf become 0 unless ``keep_bad``). ``l2_decay`` (``sc.l2 != 0``) is a constant
    of each loop that calls this: each loop is compiled once per case (its public function tests the case and
    calls the loop), as a test inside the loop split its body and spilled loop constants to the stack."""
    wj = w * sc.shrink
    graw = g * sc.gsign
    finite = abs(graw) <= sc.big  # False for NaN
    gj = graw if finite | keep_bad else zero  # bitwise: no branch in the loop
    # Only L2 decay reads the weight: 0·W would make a NaN or infinite weight a NaN gradient.
    gj = gj + sc.l2 * wj if l2_decay else gj
    return wj, gj, sc.beta2 * (rv * col_v) + sc.rest2 * (gj * gj), finite


@numba.njit(**_MATH)
def momentum_element(w, g, nonneg, col_m, col_v, rm, rv, sc, keep_bad, zero, l2_decay):
    """One element's step with the paper's code of M: its new weight, sign (0/1), capped |M| and V for
    the sums, and whether its gradient was finite."""
    wj, gj, vj, finite = element(w, g, col_v, rv, sc, keep_bad, zero, l2_decay)
    mag = rm * col_m
    mj = sc.beta1 * (mag if nonneg else -mag) + sc.rest1 * gj
    return wj - sc.lr * (mj / (math.sqrt(vj) + sc.eps)), mj >= 0, capped(abs(mj), sc.cap), capped(vj, sc.cap), finite


@numba.njit(**_MATH)
def run_with_momentum(wrow, grow, nonneg, col_m, col_v, acc_m, acc_v, rm, rv, sc, zero_nonfinite):
    """One run; ``nonneg`` holds its stored sign bits as 0/1 and gets the new ones. Returns the run's
    capped sums of |M| and V and the NaN/inf elements met."""
    if sc.l2 != 0:
        return _run_with_momentum(wrow, grow, nonneg, col_m, col_v, acc_m, acc_v, rm, rv, sc, zero_nonfinite, True)
    return _run_with_momentum(wrow, grow, nonneg, col_m, col_v, acc_m, acc_v, rm, rv, sc, zero_nonfinite, False)


@numba.njit(**_MATH)
def _run_with_momentum(wrow, grow, nonneg, col_m, col_v, acc_m, acc_v, rm, rv, sc, zero_nonfinite, l2_decay):
    zero = sc.beta2 - sc.beta2
    sum_m = zero
    sum_v = zero
    any_bad = False
    keep_bad = not zero_nonfinite
    for j in range(wrow.shape[0]):
        wrow[j], nonneg[j], a, vs, finite = momentum_element(wrow[j], grow[j], nonneg[j], col_m[j], col_v[j], rm, rv,
                                                             sc, keep_bad, zero, l2_decay)
        any_bad |= not finite
        sum_m += a
        sum_v += vs
        acc_m[j] += a
        acc_v[j] += vs
    return sum_m, sum_v, count_bad(grow, sc.big) if any_bad else 0


@numba.njit(**_MATH)
def run_pair_with_momentum(w0, g0, nonneg0, w1, g1, nonneg1, col_m, col_v, acc_m, acc_v, rm0, rv0, rm1, rv1, sc,
                           zero_nonfinite):
    """Two rows' runs over the same columns of M's and V's view: :func:`run_with_momentum` of each, in
    one loop that loads each column factor and reads and writes each column sum once for both. Returns
    each row's sums of |M| and V, and the NaN/inf elements met in both."""
    if sc.l2 != 0:
        return _run_pair(w0, g0, nonneg0, w1, g1, nonneg1, col_m, col_v, acc_m, acc_v, rm0, rv0, rm1, rv1, sc,
                         zero_nonfinite, True)
    return _run_pair(w0, g0, nonneg0, w1, g1, nonneg1, col_m, col_v, acc_m, acc_v, rm0, rv0, rm1, rv1, sc,
                     zero_nonfinite, False)


@numba.njit(**_MATH)
def _run_pair(w0, g0, nonneg0, w1, g1, nonneg1, col_m, col_v, acc_m, acc_v, rm0, rv0, rm1, rv1, sc, zero_nonfinite,
              l2_decay):
    zero = sc.beta2 - sc.beta2
    sum_m0 = zero
    sum_v0 = zero
    sum_m1 = zero
    sum_v1 = zero
    any_bad = False
    keep_bad = not zero_nonfinite
    for j in range(w0.shape[0]):
        cm, cv = col_m[j], col_v[j]
        w0[j], nonneg0[j], a0, vs0, finite0 = momentum_element(w0[j], g0[j], nonneg0[j], cm, cv, rm0, rv0, sc,
                                                               keep_bad, zero, l2_decay)
        w1[j], nonneg1[j], a1, vs1, finite1 = momentum_element(w1[j], g1[j], nonneg1[j], cm, cv, rm1, rv1, sc,
                                                               keep_bad, zero, l2_decay)
        any_bad |= not (finite0 & finite1)
        sum_m0 += a0
        sum_v0 += vs0
        sum_m1 += a1
        sum_v1 += vs1
        acc_m[j] = acc_m[j] + a0 + a1
        acc_v[j] = acc_v[j] + vs0 + vs1
    bad = count_bad(g0, sc.big) + count_bad(g1, sc.big) if any_bad else 0
    return sum_m0, sum_v0, sum_m1, sum_v1, bad


@numba.njit(**_MATH)
def run_without_momentum(wrow, grow, col_v, acc_v, rv, sc, zero_nonfinite):
    """One run without a first moment: the weights stepped with G/√V; returns V's capped sum and the NaN/inf
    elements met."""
    if sc.l2 != 0:
        return _run_without_momentum(wrow, grow, col_v, acc_v, rv, sc, zero_nonfinite, True)
    return _run_without_momentum(wrow, grow, col_v, acc_v, rv, sc, zero_nonfinite, False)


@numba.njit(**_MATH)
def _run_without_momentum(wrow, grow, col_v, acc_v, rv, sc, zero_nonfinite, l2_decay):
    lr, eps, cap = sc.lr, sc.eps, sc.cap
    zero = sc.beta2 - sc.beta2
    sum_v = zero
    any_bad = False
    keep_bad = not zero_nonfinite
    for j in range(wrow.shape[0]):
        wj, gj, vj, finite = element(wrow[j], grow[j], col_v[j], rv, sc, keep_bad, zero, l2_decay)
        any_bad |= not finite
        vs = capped(vj, cap)
        sum_v += vs
        acc_v[j] += vs
        wrow[j] = wj - lr * (gj / (math.sqrt(vj) + eps))
    return sum_v, count_bad(grow, sc.big) if any_bad else 0


@numba.njit(**_MATH)
def flagged_momentum(g_term, nonneg, above, col, high_coef, low_coef):
    """This step's M from the stored code, sign · r·c · (high where flagged, else low), times β1, plus
    ``g_term`` = (1 − β1)·G: ``high_coef``/``low_coef`` = β1·r·high / β1·r·low of the run's M row."""
    mag = (high_coef if above else low_coef) * col
    return (mag if nonneg else -mag) + g_term


@numba.njit(**_MATH)
def flag_fit(mj, estimate, cap, zero):
    """One element encoded against the new factors (``estimate`` = its R): sign and flag, and what it
    adds to the flag's least-squares sums Σ_F |M|·R, Σ_F R², Σ_¬F |M|·R, Σ_¬F R² (capped)."""
    a = abs(mj)
    flagged = a > estimate
    fit = finite_or_cap(a * estimate, cap)
    energy = finite_or_cap(estimate * estimate, cap)
    return (mj >= 0, flagged, fit if flagged else zero, energy if flagged else zero, zero if flagged else fit,
            zero if flagged else energy)


@numba.njit(**_MATH)
def flag_run_sums(wrow, grow, nonneg, above, col_m, acc_m, high_coef, low_coef, sc, zero_nonfinite):
    """First pass over a run of one M row, with L2 decay (it only reads; ``wrow`` for the decay): the capped
    |M| into ``acc_m`` and the returned row sum."""
    rest1, gsign, shrink, l2, big, cap = sc.rest1, sc.gsign, sc.shrink, sc.l2, sc.big, sc.cap
    zero = rest1 - rest1
    sum_m = zero
    keep_bad = not zero_nonfinite
    for j in range(grow.shape[0]):
        gj = grow[j]
        gj = gj if (abs(gj) <= big) | keep_bad else zero
        g_term = rest1 * (gj * gsign + l2 * (wrow[j] * shrink))
        a = capped(abs(flagged_momentum(g_term, nonneg[j], above[j], col_m[j], high_coef, low_coef)), cap)
        sum_m += a
        acc_m[j] += a
    return sum_m


@numba.njit(**_MATH)
def flag_run_update(wrow, grow, nonneg, above, col_m, acc_m, col_v, acc_v, high_coef, low_coef, rv, sc, zero_nonfinite):
    """First pass without L2 decay, over a run of one M row: the weights from this step's M
    (decoded from the stored code, whose bits are only read), the capped |M| and V into
    ``acc_m``/``acc_v``; returns |M|'s and V's row sums and the NaN/inf elements met."""
    lr, rest1, eps, cap = sc.lr, sc.rest1, sc.eps, sc.cap
    zero = sc.beta2 - sc.beta2
    sum_m = zero
    sum_v = zero
    any_bad = False
    keep_bad = not zero_nonfinite
    for j in range(wrow.shape[0]):
        wj, gj, vj, finite = element(wrow[j], grow[j], col_v[j], rv, sc, keep_bad, zero, False)
        any_bad |= not finite
        mj = flagged_momentum(rest1 * gj, nonneg[j], above[j], col_m[j], high_coef, low_coef)
        a = capped(abs(mj), cap)
        vs = capped(vj, cap)
        sum_m += a
        sum_v += vs
        acc_m[j] += a
        acc_v[j] += vs
        wrow[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
    return sum_m, sum_v, count_bad(grow, sc.big) if any_bad else 0


@numba.njit(**_MATH)
def flag_run_encode(grow, nonneg, above, col_m, new_col_m, high_coef, low_coef, new_rm, fits, sc, zero_nonfinite):
    """Second pass without L2 decay, over a run of one M row: this step's M formed again (as
    :func:`flag_run_update` forms it), its new sign and flag bits (0/1 in ``nonneg``/``above``) and
    the flag's least-squares sums (:func:`flag_fit`) added into ``fits``. Reads only the gradient."""
    rest1, big, cap = sc.rest1, sc.big, sc.cap
    zero = rest1 - rest1
    fit_high = zero
    energy_high = zero
    fit_low = zero
    energy_low = zero
    keep_bad = not zero_nonfinite
    signed_rest1 = rest1 * sc.gsign
    for j in range(grow.shape[0]):
        gj = grow[j]
        gj = gj if (abs(gj) <= big) | keep_bad else zero
        mj = flagged_momentum(signed_rest1 * gj, nonneg[j], above[j], col_m[j], high_coef, low_coef)
        nonneg[j], above[j], fh, eh, fl, el = flag_fit(mj, new_rm * new_col_m[j], cap, zero)
        fit_high += fh
        energy_high += eh
        fit_low += fl
        energy_low += el
    fits[0] += fit_high
    fits[1] += energy_high
    fits[2] += fit_low
    fits[3] += energy_low


@numba.njit(**_MATH)
def flag_run_write(wrow, grow, nonneg, above, col_m, new_col_m, col_v, acc_v, high_coef, low_coef, new_rm, rv, fits,
                   sc, zero_nonfinite):
    """Second pass with L2 decay (M needs the weights before the step), over a run of one M row:
    :func:`flag_run_encode` and the weights and V of :func:`flag_run_update` in one loop; returns
    V's row sum and the NaN/inf elements met."""
    lr, rest1, eps, cap = sc.lr, sc.rest1, sc.eps, sc.cap
    zero = sc.beta2 - sc.beta2
    sum_v = zero
    fit_high = zero
    energy_high = zero
    fit_low = zero
    energy_low = zero
    any_bad = False
    keep_bad = not zero_nonfinite
    for j in range(wrow.shape[0]):
        wj, gj, vj, finite = element(wrow[j], grow[j], col_v[j], rv, sc, keep_bad, zero, True)
        any_bad |= not finite
        mj = flagged_momentum(rest1 * gj, nonneg[j], above[j], col_m[j], high_coef, low_coef)
        nonneg[j], above[j], fh, eh, fl, el = flag_fit(mj, new_rm * new_col_m[j], cap, zero)
        fit_high += fh
        energy_high += eh
        fit_low += fl
        energy_low += el
        vs = capped(vj, cap)
        sum_v += vs
        acc_v[j] += vs
        wrow[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
    fits[0] += fit_high
    fits[1] += energy_high
    fits[2] += fit_low
    fits[3] += energy_low
    return sum_v, count_bad(grow, sc.big) if any_bad else 0


@numba.njit(inline="always")
def flag_gain(fit, energy):
    """A level of the flag from its least-squares sums: fit / energy, 0 where energy is not positive
    (:func:`smmf.functional.flag_gains`)."""
    return fit / energy if energy > 0 else 0
