"""The Compressor interface (``base``) and the built-in single-message compressors, one file per family.

Importing this package registers nothing: the method names live in one table, ``gradcomp.registry.BUILTIN``.
The classes most used directly are re-exported here.
"""

from gradcomp.compressors.base import Compressor, Fields, Slot
from gradcomp.compressors.dense import BFloat16, Float16, NoCompression
from gradcomp.compressors.sbc import SparseBinary, SparseTernary
from gradcomp.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum
from gradcomp.compressors.sparse import RandomBlock, RandomK, Threshold, TopK

__all__ = [
    "BFloat16", "Compressor", "EFSignSGD", "Fields", "Float16", "NoCompression", "OneBit", "RandomBlock", "RandomK",
    "SignSGD", "Signum", "Slot", "SparseBinary", "SparseTernary", "Threshold", "TopK",
]
