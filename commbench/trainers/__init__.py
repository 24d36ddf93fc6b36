"""Models, data, gradient-sync strategies and the minimal training loop.

- :mod:`~commbench.trainers.models`: ``build_model`` (no distributed code in it).
- :mod:`~commbench.trainers.data`: synthetic, MNIST and CIFAR-10 datasets, read locally.
- :mod:`~commbench.trainers.bucketing`: bucket assignment and gradient traffic per epoch (pure).
- :mod:`~commbench.trainers.sync`: none, naive, ring, bucketed, ddp (dp, vanilla-dp on CUDA).
- :mod:`~commbench.trainers.loop`: ``TrainConfig``, ``Trainer`` and ``run_rank``.
"""

from commbench.trainers.data import DATASETS, build_dataset
from commbench.trainers.loop import TrainConfig, Trainer, run_rank
from commbench.trainers.models import MODELS, build_model, trainable_parameters
from commbench.trainers.sync import STRATEGIES

__all__ = [
    "DATASETS",
    "MODELS",
    "STRATEGIES",
    "TrainConfig",
    "Trainer",
    "build_dataset",
    "build_model",
    "run_rank",
    "trainable_parameters",
]
