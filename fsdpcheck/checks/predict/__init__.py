"""What each known weight loader would do with these ranks: ok, hang, corrupt, or refuse.

Each loader pairs tensors across ranks its own way (one module per loader); we replay that
pairing on the fingerprints of the reference group and every other usable group, over the walk
they share (:mod:`.pairing`). Pure: no torch.
"""

from fsdpcheck.checks.predict.ddp_sync import DDP_BUCKET_BYTES
from fsdpcheck.checks.predict.registry import (
    BACKENDS,
    LOADERS,
    PRODUCTS,
    REGISTRY,
    LoaderModel,
    backend_of,
    predict_loaders,
    products,
)
from fsdpcheck.checks.predict.sizes import ITEMSIZE, itemsize, nbytes

__all__ = [
    "BACKENDS",
    "DDP_BUCKET_BYTES",
    "ITEMSIZE",
    "LOADERS",
    "PRODUCTS",
    "REGISTRY",
    "LoaderModel",
    "backend_of",
    "itemsize",
    "nbytes",
    "predict_loaders",
    "products",
]
