"""Linear layers that take a few rows at once with the weights on the left: (weight @ rows.T).T for rows @ weight.T.

On a CPU, MKL multiplies a few rows (2 to `FEW_ROWS`: a batch's decode step, one token per stream) by a wide weight
(more outputs than inputs: an MLP's gate and up projections, the vocabulary's) about twice as fast this way round; the
other way it runs far from the speed of reading the weights, which sets a decode step's pace (on the 0.5B default,
one thread, 4 rows: the vocabulary's projection 39 against 102 ms, a 4864 x 896 projection 1.1 against 2.1 ms; a
batched decode step 399 against 522 ms). Narrow weights are faster the usual way (a 896 x 4864 projection 1.4
against 2.3 ms) and keep it, as does one row and every other shape, on every device.

The way round is taken only inside `weights_left()`, which a batch's decode step (engine/memory/batched_step.py)
holds around its model call: a stream's own blocks of a few tokens keep torch's path, so its memory is the same
bit for bit whether the model ever served a batch or not. The flag is the calling thread's.
"""

from __future__ import annotations

import threading
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEW_ROWS = 8

_batch_step = threading.local()  # `on`: this thread is inside `weights_left()`


@contextmanager
def weights_left():
    """Within it, on this thread, wide linears take 2 to FEW_ROWS rows weights-left."""
    before = getattr(_batch_step, "on", False)
    _batch_step.on = True
    try:
        yield
    finally:
        _batch_step.on = before


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 < rows <= FEW_ROWS or x.device.type != "cpu" or not getattr(_batch_step, "on", False):
        return F.linear(x, self.weight, self.bias)
    out = torch.mm(self.weight, x.reshape(rows, -1).t()).t().reshape(*x.shape[:-1], -1)
    return out if self.bias is None else out + self.bias


def weights_left_for_few_rows(model: nn.Module) -> None:
    """Every wide `nn.Linear` of `model` takes a few rows with its weight on the left (inside `weights_left()`)."""
    for module in model.modules():
        if type(module) is nn.Linear and module.out_features > module.in_features:
            module.forward = types.MethodType(_forward, module)
