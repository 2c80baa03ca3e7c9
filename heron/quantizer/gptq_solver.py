"""GPTQ (Frantar et al., 2022): one linear's weight quantized column by column, each
column's rounding error spread onto the columns not yet quantized through the inverse
Hessian of the layer's reconstruction loss ||X W^T - X Wq^T||^2 (H = 2 X^T X / n).

The implementation follows the paper's practical form: the upper Cholesky factor of
H^-1 (dampened by ``damp * mean(diag H)``), lazy updates in blocks of ``block_size`` columns,
columns with no signal (diag H = 0) zeroed, optional activation order (columns visited by
decreasing diag H; groups then follow the visiting order and ``g_idx`` maps each input
column to its group), group-wise grids fitted on the error-updated weights when a group
starts.
"""

from __future__ import annotations

import torch

from heron.quantizer.intgrid import IntQuant, dequant_grid, gptq_grid, num_groups, round_to_grid


class HessianAccumulator:
    """The running H = 2 X^T X / n over the rows of the inputs seen by one linear."""

    def __init__(self, in_features: int):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        m = x.shape[0]
        if m == 0:
            return
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H.addmm_(x.t(), x)


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1; more dampening if needed."""
    mean_diag = float(torch.mean(torch.diag(H)))
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    for attempt in range(6):
        Hd = H + (damp * 10 ** attempt) * mean_diag * eye
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
    raise ValueError("GPTQ: the Hessian is not positive definite even with heavy dampening")


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = True, act_order: bool = False, damp: float = 0.01,
                  block_size: int = 128, scale_dtype: torch.dtype = torch.float16) -> IntQuant:
    """GPTQ of ``weight`` (N, K) given its input Hessian ``H`` (K, K) -> ``IntQuant``."""
    W = weight.detach().to(torch.float32).clone()
    H = H.detach().to(torch.float32).clone()
    n, k = W.shape
    if H.shape != (k, k):
        raise ValueError(f"Hessian {tuple(H.shape)} does not match weight {tuple(W.shape)}")
    gs = k if group_size == -1 else group_size
    groups = num_groups(k, group_size)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    U = _inverse_cholesky(H, damp)
    del H

    Q = torch.zeros(n, k, dtype=torch.int64)
    scales = torch.zeros(groups, n)
    zeros = torch.zeros(groups, n, dtype=torch.int64)
    scale = zero = None
    if group_size == -1:
        scale, zero = gptq_grid(W, bits, sym, scale_dtype=scale_dtype)
        scales[0], zeros[0] = scale, zero

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if group_size != -1 and col % gs == 0:
                end = min(col + gs, k)  # the group's columns, as updated so far
                cols = W1[:, i:i + (end - col)]
                if end > i2:
                    cols = torch.cat([W1[:, i:], W[:, i2:end]], dim=1)
                scale, zero = gptq_grid(cols, bits, sym, scale_dtype=scale_dtype)
                scales[col // gs], zeros[col // gs] = scale, zero
            w = W1[:, i:i + 1]
            q = round_to_grid(w, scale, zero, bits)
            Q[:, col] = q[:, 0]
            err = (w - dequant_grid(q, scale, zero)) / U1[i, i]
            W1[:, i:] -= err * U1[i:i + 1, i:]
            Err1[:, i:i + 1] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    g_idx = torch.arange(k) // gs  # group of each visited position
    if perm is not None:
        inv = torch.argsort(perm)
        Q, g_idx = Q[:, inv], g_idx[inv]
    return IntQuant(Q.to(torch.uint8), scales, zeros, g_idx, bits, group_size, sym,
                    scale_dtype)
