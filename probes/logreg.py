"""Many logistic regressions (and ridges) over shared features, fitted as one batched problem.

The objective is scikit-learn's, probe by probe: mean log-loss over the probe's training rows
plus ``||w||^2 / (2 C n)`` with the intercept unpenalised; binary targets get one weight vector
(sklearn's binary formulation; a 2-class softmax would halve the penalty), multinomial targets
``K`` vectors. Probes are independent, so the sum of their objectives has a block-diagonal
Hessian and L-BFGS on the sum reaches every probe's own optimum. Batching buys one matmul
``[G, n, d] @ [G, d, P]`` per evaluation instead of P small ones (docs/design.md#blas-threads-and-dask-buffers).

Two things make it several times faster than one sklearn fit per probe on one core:

* **Preconditioning.** The solve runs in whitened coordinates ``v = R^-1 w`` with
  ``R = V (E + delta)^-1/2`` from the eigendecomposition ``X^T X / n = V E V^T``. The penalty
  becomes the diagonal ``sum_j v_j^2 / (e_j + delta)``, so the objective (and its optimum) are
  unchanged, but L-BFGS sees a Hessian close to a multiple of the identity: ~35 iterations to
  converge instead of >100 to hit sklearn's iteration cap. ``delta = 4 / (C n)`` balances the
  penalty's curvature against the data's (sigmoid slope <= 1/4).
* **Hand-written gradients.** No autograd graph: two matmuls and three elementwise passes per
  evaluation, so the reported FLOP count is exact up to the elementwise work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: Above this width the d^3 eigendecomposition stops paying for itself; plain L-BFGS then.
MAX_PRECONDITION_DIM = 2048


@dataclass
class SolveInfo:
    """How a batched solve went: iterations, function evaluations, FLOPs (matmuls only)."""

    n_iter: int = 0
    n_evals: int = 0
    flops: float = 0.0
    converged: bool = True
    max_grad: float = 0.0


@dataclass
class BatchedLogReg:
    """Fitted weights of P probes over G feature sets, in the original feature space.

    Binary probes live in ``wb[G, d, Pb]``/``bb[G, Pb]``, multinomial ones in
    ``wm[G, d, Pm, K]``/``bm[G, Pm, K]`` (classes beyond a probe's own count stay masked).
    ``order[p]`` is ``("binary" | "multi", column)``.
    """

    n_classes: np.ndarray
    order: list[tuple[str, int]]
    wb: torch.Tensor | None = None
    bb: torch.Tensor | None = None
    wm: torch.Tensor | None = None
    bm: torch.Tensor | None = None
    info: SolveInfo = field(default_factory=SolveInfo)

    def predict(self, X: torch.Tensor) -> np.ndarray:
        """Class codes [G, m, P] for X [G, m, d], in the probes' order."""
        g, m = X.shape[0], X.shape[1]
        out = np.empty((g, m, len(self.order)), dtype=np.int64)
        if self.wb is not None and self.bb is not None:
            zb = torch.baddbmm(self.bb.unsqueeze(1), X, self.wb)
        if self.wm is not None and self.bm is not None:
            _, d, pm, k = self.wm.shape
            zm = torch.baddbmm(self.bm.reshape(g, 1, pm * k), X, self.wm.reshape(g, d, pm * k)).reshape(g, m, pm, k)
            multi = [p for p, (f, _) in enumerate(self.order) if f == "multi"]
            zm = zm + _class_mask(self.n_classes[multi], k)
        for p, (family, col) in enumerate(self.order):
            out[:, :, p] = (zb[:, :, col] > 0).numpy() if family == "binary" else zm[:, :, col].argmax(-1).numpy()
        return out

    def weights(self, g: int, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(coef [K', d], intercept [K']) of probe p on feature set g, in sklearn's layout
        (K' = 1 for a binary probe)."""
        family, col = self.order[p]
        if family == "binary":
            assert self.wb is not None and self.bb is not None, "a binary probe has binary weights"
            return self.wb[g, :, col].numpy()[None, :].copy(), self.bb[g, col].numpy()[None].copy()
        k = int(self.n_classes[p])
        assert self.wm is not None and self.bm is not None, "a multi-class probe has multi-class weights"
        return self.wm[g, :, col, :k].numpy().T.copy(), self.bm[g, col, :k].numpy().copy()


def _class_mask(n_classes: np.ndarray, k: int) -> torch.Tensor:
    mask = torch.zeros(len(n_classes), k)
    for i, n in enumerate(n_classes):
        mask[i, int(n):] = float("-inf")
    return mask


def fit_logistic(
    X: torch.Tensor,
    Y: np.ndarray,
    n_classes: np.ndarray | list[int],
    *,
    mask: np.ndarray | None = None,
    C: float | np.ndarray = 1.0,
    max_iter: int = 100,
    tol: float = 1e-4,
    precondition: bool = True,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BatchedLogReg:
    """Fit P logistic regressions on G shared feature sets.

    X: [G, n, d] float32 (e.g. G layers over the same rows). Y: [n, P] class codes, -1 where a
    probe has no label. mask: [n, P], the rows each probe trains on (default: all labelled).
    n_classes: [P], each >= 2. C: sklearn's inverse regularisation, one value or one per probe.
    moments: (mean [G, 1, d], covariance [G, d, d] float64) of the rows to whiten with, when X is
    a subsample of them (out of core: probes/subsample.py); default: X's own.
    """
    if X.ndim != 3:
        raise ValueError(f"X must be [G, n, d] (feature sets, rows, dims), got shape {tuple(X.shape)}")
    X = X.to(torch.float32)
    Y = np.asarray(Y)
    if Y.ndim != 2 or Y.shape[0] != X.shape[1]:
        raise ValueError(f"Y must be [n, P] with n = {X.shape[1]} (the rows of X), got shape {Y.shape}")
    n_classes = np.asarray(n_classes, dtype=np.int64)
    if n_classes.shape != (Y.shape[1],) or (n_classes < 2).any():
        raise ValueError(f"n_classes must give P = {Y.shape[1]} counts, each >= 2, got {n_classes.tolist()}")
    if (Y >= n_classes[None, :]).any():
        raise ValueError("a label code is >= its probe's n_classes: encode labels as 0..K-1 (-1 = no label)")
    valid = Y >= 0
    if mask is not None:
        valid &= np.asarray(mask, dtype=bool)
    c = np.broadcast_to(np.asarray(C, dtype=np.float64), (Y.shape[1],)).copy()
    order: list[tuple[str, int]] = []
    counts = {"binary": 0, "multi": 0}
    for p in range(Y.shape[1]):
        family = "binary" if n_classes[p] == 2 else "multi"
        order.append((family, counts[family]))
        counts[family] += 1
    fit = BatchedLogReg(n_classes=n_classes, order=order)
    n_rows = max(int(valid.any(1).sum()), 1)
    pre = _Preconditioner(X, delta=4.0 / (float(np.median(c)) * n_rows), enabled=precondition, moments=moments)
    fit.info.flops += pre.flops
    binary, multi = np.flatnonzero(n_classes == 2), np.flatnonzero(n_classes > 2)
    if len(binary):
        v, b, info = _fit_binary(pre, Y[:, binary], valid[:, binary], c[binary], max_iter, tol)
        fit.wb, fit.bb = pre.to_original(v, b)
        _add(fit.info, info)
    if len(multi):
        k = int(n_classes[multi].max())
        v, b, info = _fit_multi(pre, Y[:, multi], valid[:, multi], n_classes[multi], c[multi], max_iter, tol)
        g, d = v.shape[0], v.shape[1]
        w, b = pre.to_original(v, b)
        fit.wm, fit.bm = w.reshape(g, d, len(multi), k), b.reshape(g, len(multi), k)
        _add(fit.info, info)
    return fit


class _Preconditioner:
    """Whitened, centred features Z = (X - mu) R and the diagonal penalty scale of v-space."""

    def __init__(self, X: torch.Tensor, delta: float, enabled: bool,
                 moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        g, n, d = X.shape
        self.flops = 0.0
        if not enabled or d > MAX_PRECONDITION_DIM:
            self.Z, self.R, self.mu = X, None, None
            self.pen = torch.ones(g, d, 1)
            return
        if moments is None:
            self.mu = X.mean(1, keepdim=True)                                  # [G, 1, d]
            xc = X - self.mu
            cov = torch.bmm(xc.transpose(1, 2), xc).double() / n               # [G, d, d]
            del xc
            self.flops = g * 2.0 * n * d * d
        else:  # streamed over every training row; X is a subsample of them
            self.mu, cov = moments[0].float(), moments[1].double()
        e, V = torch.linalg.eigh(cov)
        e = e.clamp_min(0.0)
        self.R = (V / torch.sqrt(e + delta).unsqueeze(1)).float()             # [G, d, d]
        self.Z = torch.bmm(X - self.mu, self.R)
        self.pen = (1.0 / (e + delta)).float().unsqueeze(-1)                  # [G, d, 1]
        self.flops += g * (2.0 * n * d * d + 9.0 * d**3)

    def to_original(self, v: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.R is None:
            return v, b
        w = torch.bmm(self.R, v)                                               # [G, d, P]
        assert self.mu is not None, "the whitening sets mu with R"
        return w, b - torch.bmm(self.mu, w).squeeze(1)


def _add(total: SolveInfo, one: SolveInfo) -> None:
    total.n_iter += one.n_iter
    total.n_evals += one.n_evals
    total.flops += one.flops
    total.converged = total.converged and one.converged
    total.max_grad = max(total.max_grad, one.max_grad)


def _row_weights(valid: np.ndarray, C: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    n_p = np.maximum(valid.sum(0).astype(np.float64), 1.0)
    row_w = torch.from_numpy((valid / n_p).astype(np.float32))                # mean over the probe's rows
    lam = torch.from_numpy((1.0 / (C * n_p)).astype(np.float32))              # sklearn's 1 / (C n)
    return row_w, lam


def _lbfgs(params: list[torch.Tensor], closure, max_iter: int, tol: float) -> SolveInfo:
    opt = torch.optim.LBFGS(
        params, lr=1.0, max_iter=max_iter, max_eval=int(max_iter * 1.5) + 5, tolerance_grad=tol,
        tolerance_change=1e-12, history_size=10, line_search_fn="strong_wolfe",
    )
    opt.step(closure)
    state = opt.state[opt._params[0]]
    max_grad = float(max(p.grad.abs().max() for p in params if p.grad is not None))
    return SolveInfo(n_iter=int(state.get("n_iter", 0)), n_evals=int(state.get("func_evals", 0)),
                     converged=max_grad <= tol, max_grad=max_grad)


def _fit_binary(pre: _Preconditioner, Y, valid, C, max_iter, tol):
    Z = pre.Z
    g, n, d = Z.shape
    p = Y.shape[1]
    # With s = 1 - 2y the loss is softplus(s z) and its derivative s sigmoid(s z): one sign flip,
    # one softplus, one sigmoid per evaluation.
    sign = torch.from_numpy(np.where(Y == 1, -1.0, 1.0).astype(np.float32))
    row_w, lam = _row_weights(valid, C)
    signed_w = row_w * sign
    pl = pre.pen * lam                                                        # [G, d, P]
    v = torch.zeros(g, d, p, requires_grad=True)
    b = torch.zeros(g, p, requires_grad=True)
    Zt = Z.transpose(1, 2).contiguous()  # a contiguous Z^T makes the gradient matmul ~20 % faster

    def closure() -> torch.Tensor:
        with torch.no_grad():
            t = torch.baddbmm(b.unsqueeze(1), Z, v).mul_(sign)               # [G, n, P]
            loss = (torch.nn.functional.softplus(t) * row_w).sum() + 0.5 * (pl * v * v).sum()
            resid = torch.sigmoid(t).mul_(signed_w)
            v.grad = torch.baddbmm(pl * v, Zt, resid)
            b.grad = resid.sum(1)
        return loss

    info = _lbfgs([v, b], closure, max_iter, tol)
    info.flops = info.n_evals * 4.0 * g * n * d * p
    return v.detach(), b.detach(), info


def _fit_multi(pre: _Preconditioner, Y, valid, n_classes, C, max_iter, tol):
    Z = pre.Z
    g, n, d = Z.shape
    p = Y.shape[1]
    k = int(n_classes.max())
    onehot = torch.zeros(n, p, k)
    onehot.scatter_(2, torch.from_numpy(np.where(Y >= 0, Y, 0).astype(np.int64)).unsqueeze(-1), 1.0)
    row_w, lam = _row_weights(valid, C)
    row_w = row_w.unsqueeze(-1)                                               # [n, P, 1]
    cmask = _class_mask(n_classes, k)                                         # [P, K], -inf past K_p
    pl = pre.pen * lam.repeat_interleave(k)                                   # [G, d, P*K]
    v = torch.zeros(g, d, p * k, requires_grad=True)
    b = torch.zeros(g, p * k, requires_grad=True)
    Zt = Z.transpose(1, 2).contiguous()

    def closure() -> torch.Tensor:
        with torch.no_grad():
            z = torch.baddbmm(b.unsqueeze(1), Z, v).reshape(g, n, p, k) + cmask
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            picked = (z.masked_fill(onehot == 0, 0.0)).sum(-1, keepdim=True)
            loss = (row_w * (lse - picked)).sum() + 0.5 * (pl * v * v).sum()
            resid = (row_w * (torch.exp(z - lse) - onehot)).reshape(g, n, p * k)
            v.grad = torch.baddbmm(pl * v, Zt, resid)
            b.grad = resid.sum(1)
        return loss

    info = _lbfgs([v, b], closure, max_iter, tol)
    info.flops = info.n_evals * 4.0 * g * n * d * p * k
    return v.detach(), b.detach(), info


# ----------------------------------------------------------------------------- ridge


def fit_ridge(X: torch.Tensor, Y: np.ndarray, *, mask: np.ndarray | None = None, alpha: float = 1.0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form ridge (sklearn's ``Ridge(alpha)``: ||y - Xw - b||^2 + alpha ||w||^2) for P
    targets on G feature sets. Y: [n, P] float, NaN = no label. Returns W [G, d, P], b [G, P].
    Probes with the same rows share one Gram matrix."""
    Y = np.asarray(Y, dtype=np.float64)
    valid = ~np.isnan(Y)
    if mask is not None:
        valid &= np.asarray(mask, dtype=bool)
    g, n, d = X.shape
    W = torch.zeros(g, d, Y.shape[1])
    B = torch.zeros(g, Y.shape[1])
    patterns: dict[bytes, list[int]] = {}
    for p in range(Y.shape[1]):
        patterns.setdefault(np.packbits(valid[:, p]).tobytes(), []).append(p)
    Xd = X.double()
    for cols in patterns.values():
        rows = torch.from_numpy(np.flatnonzero(valid[:, cols[0]]))
        if len(rows) == 0:
            continue
        xs = Xd[:, rows]
        mu = xs.mean(1, keepdim=True)
        xc = xs - mu
        ys = torch.from_numpy(Y[rows.numpy()][:, cols])
        ym = ys.mean(0)
        gram = torch.bmm(xc.transpose(1, 2), xc) + alpha * torch.eye(d, dtype=torch.float64)
        w = torch.linalg.solve(gram, torch.matmul(xc.transpose(1, 2), (ys - ym)))  # [G, d, len(cols)]
        W[:, :, cols] = w.float()
        B[:, cols] = (ym - torch.bmm(mu, w).squeeze(1)).float()
    return W, B


def standardization_stats(X: torch.Tensor, standardize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and scale over rows of X [G, m, d] (population std, like StandardScaler)."""
    if not standardize or X.shape[1] == 0:
        return torch.zeros(X.shape[0], 1, X.shape[2]), torch.ones(X.shape[0], 1, X.shape[2])
    mean = X.mean(1, keepdim=True, dtype=torch.float64)
    var = (X.double() - mean).pow(2).mean(1, keepdim=True)
    scale = var.sqrt()
    scale[scale < 1e-8] = 1.0  # constant features stay at zero instead of dividing by ~0
    return mean.float(), scale.float()


class Solved:
    """Solver output for columns of labels: weights in standardised space, classes per column."""

    def __init__(self, mean, scale, classes, fit, solvable, info):
        self.mean, self.scale, self.classes, self.fit, self.solvable, self.info = mean, scale, classes, fit, solvable, info

    def weights(self, g: int, col: int) -> tuple[np.ndarray, np.ndarray]:
        if col in self.solvable:
            return self.fit.weights(g, self.solvable[col])
        d = self.mean.shape[-1]
        return np.zeros((1, d), np.float32), np.zeros(1, np.float32)

    def predict(self, Xs: torch.Tensor) -> list[np.ndarray]:
        """Original class codes per column, [G, m] each."""
        G, m = Xs.shape[0], Xs.shape[1]
        codes = self.fit.predict(Xs) if self.fit is not None else None
        out = []
        for col, classes in enumerate(self.classes):
            if col in self.solvable:
                assert codes is not None, "a solvable column was fitted"
                out.append(classes[codes[:, :, self.solvable[col]]])
            else:
                out.append(np.full((G, m), classes[0] if len(classes) else -1, dtype=np.int64))
        return out


def solve_columns(Xtr: torch.Tensor, labels: list[np.ndarray], params: Any) -> Solved:
    """Standardise X [G, m, d] and fit one logistic regression per label column ([m] codes)."""
    mean, scale = standardization_stats(Xtr, params.standardize)
    return solve_standardized((Xtr - mean) / scale, labels, params, mean, scale)


def solve_standardized(Xs: torch.Tensor, labels: list[np.ndarray], params: Any, mean: torch.Tensor,
                       scale: torch.Tensor, moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> Solved:
    """:func:`solve_columns` on features already standardised with (mean, scale); ``moments``:
    the standardised rows' mean and covariance when Xs is a subsample of them."""
    classes = [np.unique(y[y >= 0]) for y in labels]
    solvable = {c: i for i, c in enumerate(c for c in range(len(labels)) if len(classes[c]) >= 2)}
    fit = None
    info = SolveInfo()
    if solvable:
        cols = list(solvable)
        Y = np.stack([np.searchsorted(classes[c], np.where(labels[c] >= 0, labels[c], classes[c][0])) for c in cols], 1)
        Y[np.stack([labels[c] < 0 for c in cols], 1)] = -1
        fit = fit_logistic(Xs, Y, [len(classes[c]) for c in cols], C=params.C, max_iter=params.max_iter,
                           tol=params.tol, precondition=params.precondition, moments=moments)
        info = fit.info
    return Solved(mean, scale, classes, fit, solvable, info)
