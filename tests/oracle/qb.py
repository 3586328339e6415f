"""Quantile Balancing in NumPy, from docs/qb.md: the solver step and the routing tie rule,
shared by the QB and LatentMoE cross-checks."""
import numpy as np


def kth_largest(a, r, axis):
    """r-th largest (1-based) along an axis, as a value."""
    size = a.shape[axis]
    return np.sort(a, axis=axis).take(size - r, axis=axis)


def route(s, beta, k):
    """Top-k by the tie rule: biased score desc, then raw score desc, then index asc."""
    m, n = s.shape
    index = np.broadcast_to(np.arange(n), (m, n))
    order = np.lexsort((index, -s, -(s - beta[None, :])), axis=-1)
    return order[:, :k].astype(np.int64)


def solver_step(s, beta, k, q):
    """One alternating iteration from beta: (alpha, beta, selection under the new beta)."""
    alpha = kth_largest(s - beta[None, :], k + 1, axis=1)
    beta = kth_largest(s - alpha[:, None], q + 1, axis=0)
    selection = route(s, beta, k)
    return alpha, beta, selection
