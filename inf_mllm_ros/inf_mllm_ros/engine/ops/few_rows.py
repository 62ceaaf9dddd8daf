"""Linear layers that take a few rows at once about as fast as one: a batch's decode step, one token per stream.

A decode step is bound by reading the weights, so 4 rows should cost about what one does. On a CPU, torch's own
linear (MKL) runs far from that: on the 0.5B default's MLP, two threads, 4 rows take twice one row's time (107
against 58 ms for the 24 layers' gate, up and down projections). Two ways round it, chosen per layer when the model
is prepared (`prepare_linears`, at the adapter's construction):

- **Packed weights** (oneDNN): a float32 linear on the CPU whose weight no other module shares keeps it in oneDNN's
  own layout (`torch.ops.mkldnn._reorder_linear_weight`, the layout torch's own inductor uses for CPU linears) and
  multiplies through it for every input: 4 rows 70 against 57 ms for one on the MLP above, 64 rows (a block going
  in) a little faster than MKL. The weight is replaced, not copied: one copy of the model. A row's result mostly
  does not depend on how many rows come with it (a narrow weight's single row takes another kernel, within float
  tolerance). Where oneDNN is not there or refuses the weight (another CPU's build, another precision), the layer
  keeps torch's path.
- **Weights on the left**, for a weight that another module shares (a vocabulary projection tied to the input
  embeddings, whose table must stay dense for the lookup): inside a batch's step (`weights_left()`), 2 to
  `FEW_ROWS` rows go as (weight @ rows.T).T, about twice as fast as rows @ weight.T for wide weights (the
  vocabulary's projection, one thread, 4 rows: 39 against 102 ms); everywhere else torch's own path, so a stream's
  own steps and blocks are the same whether the model ever served a batch or not.
"""

from __future__ import annotations

import threading
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEW_ROWS = 8
# oneDNN keeps about half a megabyte for every count of rows it has multiplied (its kernels and their state, on this
# CPU; up to its caches' bounds, hundreds of megabytes), so a packed linear takes more rows than this padded to a
# multiple of it: at most this many counts and a few dozen more in a long run, where questions with what they
# retrieve, of every length, would make hundreds. A text of up to 64 tokens is not padded, nor a full block. Rows are
# independent, so the padding changes no row's result.
ROW_BUCKET = 64

_batch_step = threading.local()  # `on`: this thread is inside `weights_left()`


@contextmanager
def weights_left():
    """Within it, on this thread, wide linears whose weight is shared take 2 to FEW_ROWS rows weights-left."""
    before = getattr(_batch_step, "on", False)
    _batch_step.on = True
    try:
        yield
    finally:
        _batch_step.on = before


def _weights_left_forward(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 < rows <= FEW_ROWS or x.device.type != "cpu" or not getattr(_batch_step, "on", False):
        return F.linear(x, self.weight, self.bias)
    out = torch.mm(self.weight, x.reshape(rows, -1).t()).t().reshape(*x.shape[:-1], -1)
    return out if self.bias is None else out + self.bias


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias through oneDNN, `weight` packed (or dense), any count of rows as it comes."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_forward(self: nn.Linear, x: Tensor) -> Tensor:
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        raise RuntimeError(f"a linear packed for the CPU in float32 got a {x.dtype} input on {x.device}")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = -(-rows // ROW_BUCKET) * ROW_BUCKET
    if rows <= ROW_BUCKET or padded == rows:
        return onednn_linear(x, self.weight, self.bias)
    flat = torch.zeros(padded, x.shape[-1], dtype=x.dtype)
    flat[:rows] = x.reshape(rows, -1)
    out = onednn_linear(flat, self.weight, self.bias)[:rows]
    return out.reshape(*x.shape[:-1], -1)


def is_packed(module: nn.Module) -> bool:
    """Whether a linear holds its weight in oneDNN's layout."""
    return isinstance(module, nn.Linear) and module.weight.is_mkldnn


def dense(tensor: Tensor) -> Tensor:
    """A parameter in torch's own layout (a packed weight unpacked: the same numbers)."""
    return tensor.to_dense() if tensor.is_mkldnn else tensor


def _pack(weight: Tensor) -> Tensor | None:
    """`weight` in oneDNN's layout for linears, or None where this build cannot."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        probe = torch.zeros(2, weight.shape[1])
        if onednn_linear(probe, packed).shape != (2, weight.shape[0]):
            return None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return packed


def prepare_linears(model: nn.Module) -> None:
    """Every `nn.Linear` of `model` that can takes its weight packed; of the others, the wide ones whose weight is
    shared take a batch's few rows weights-left. Idempotent."""
    shared = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        shared[id(param)] = shared.get(id(param), 0) + 1
    for module in model.modules():
        if type(module) is not nn.Linear or "forward" in vars(module):
            continue
        packed = None if shared.get(id(module.weight), 0) > 1 else _pack(module.weight)
        if packed is not None:
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.forward = types.MethodType(_packed_forward, module)
        elif module.out_features > module.in_features:
            module.forward = types.MethodType(_weights_left_forward, module)


def unpack_linears(model: nn.Module) -> None:
    """Every packed linear of `model` back to torch's own weight and path (the wide ones weights-left in a batch's
    step), for torch.compile on the CPU: inductor takes no packed weight as a graph's constant, and packs the linears
    it compiles itself."""
    for module in model.modules():
        if is_packed(module):
            module.weight = nn.Parameter(dense(module.weight), requires_grad=False)
            del module.forward
            if module.out_features > module.in_features:
                module.forward = types.MethodType(_weights_left_forward, module)


__all__ = ["FEW_ROWS", "ROW_BUCKET", "dense", "is_packed", "onednn_linear", "prepare_linears", "unpack_linears",
           "weights_left"]
