"""ncclavg: fused all-reduce averaging of gradient buckets, CPU master weights, multi-tower training."""
from ._version import __version__
from ._ext import cuda_available, cuda_built
from .errors import CommTimeoutError, CudaError, LayoutMismatchError, NcclError
from .info import build_info
from . import ops
from .bucketing import Bucket, BucketPlan, ParamSlot
from .comm import Communicator, Work
from .averager import GradientAverager
from . import optim
from .master import MasterWeights
from .trainer import TowerTrainer

__all__ = [
    "__version__", "build_info", "cuda_available", "cuda_built", "ops", "optim", "MasterWeights", "TowerTrainer",
    "NcclError", "CudaError", "CommTimeoutError", "LayoutMismatchError",
    "Bucket", "BucketPlan", "ParamSlot", "Communicator", "Work", "GradientAverager",
]
