"""eaglespec's CPU backend: C kernels for few-row linear layers, row-exact attention and one-call
decoder layers (`kernels`, `attention`, `lean`), packed and quantized targets (`quant`), the draft
head on them (`head`), and `CpuBackend`, which plugs all of it into `eaglespec.spec`."""

from .backend import CpuBackend
from .head import pack_head

__all__ = ["CpuBackend", "pack_head"]
