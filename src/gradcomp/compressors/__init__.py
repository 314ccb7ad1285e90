"""Built-in compressors; importing this package registers them all."""

import gradcomp.compressors.dgc  # noqa: F401, RUF100  (registers dgc)
import gradcomp.compressors.qsgd  # noqa: F401  (registers qsgd)
from gradcomp.compressors import natural  # noqa: F401  (registers cnat, dithering and terngrad)
from gradcomp.compressors.base import Compressor, Fields, Slot
from gradcomp.compressors.dense import BFloat16, Float16, NoCompression
from gradcomp.compressors.sbc import SparseBinary, SparseTernary
from gradcomp.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum
from gradcomp.compressors.sparse import RandomBlock, RandomK, Threshold, TopK

__all__ = [
    "BFloat16", "Compressor", "EFSignSGD", "Fields", "Float16", "NoCompression", "OneBit", "RandomBlock", "RandomK",
    "SignSGD", "Signum", "Slot", "SparseBinary", "SparseTernary", "Threshold", "TopK",
]
