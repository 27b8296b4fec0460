"""A user's adapter type, registered by a module a config lists under `imports:` (tests/test_user_adapter.py): a LoRA
whose first factor starts at a scale of its own, `adapter_args: {init_std: ...}` (its one option), under its own
tensor names so that a file says which type wrote it."""
import math
import torch
from torch import nn
from cascade_nb.adapters import Adapter, register_adapter
from cascade_nb.typed_yaml import Range

@register_adapter("pair")
class PairLoRA(Adapter):
    "ΔW = (alpha/rank)·pair_b @ pair_a, pair_b = 0 and pair_a ~ N(0, init_std²) at init."
    signature, keys, row_tensors = "pair_a", ("rank", "lora_alpha"), ("pair_b",)
    names = ("pair_a", "pair_b")
    own_options = {"init_std": (float, 0.02, Range(0, 1, lo_open=True))}
    def __init__(self, shape, rank=4, lora_alpha=1.0, init_std=0.02):
        super().__init__(shape, lora_alpha)
        self.rank, self._options = rank, {"init_std": init_std}
        self.pair_a = nn.Parameter(torch.randn(rank, math.prod(shape[1:])) * init_std)   # (r, in·k·k)
        self.pair_b = nn.Parameter(torch.zeros(shape[0], rank))                        # (out, r)

    def update(self, W=None) -> torch.Tensor:
        return (self.pair_b @ self.pair_a).view(self.shape) * (self.alpha / self.rank)

    @classmethod
    def build(cls, W, rank=4, lora_alpha=1.0, init_std=0.02): return cls(W.shape, rank, lora_alpha, init_std)
    @classmethod
    def from_tensors(cls, tensors, alpha, shape, options=None):
        self = super().from_tensors(tensors, alpha, shape, options)
        self.rank = self.pair_a.shape[0]
        return self
    @classmethod
    def claims(cls, names): return "pair_a" in names
    @classmethod
    def matrix_shape(cls, t):
        a, b = t["pair_a"], t["pair_b"]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"pair_a {tuple(a.shape)}, pair_b {tuple(b.shape)} do not fit: expected (r, in), (out, r)")
        return b.shape[0], a.shape[1]
