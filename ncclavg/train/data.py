"""Data for `ncclavg train` and the tests: scikit-learn's bundled digits (no download), synthetic data for
throughput runs, and a small in-memory loader whose position (epoch, batch) can be checkpointed.

Note [Resumable shuffling]
The order of epoch e is a pure function of (seed, e): a fresh generator seeded from both draws the
permutation. The loader therefore never carries RNG state that has to be saved; its whole state is
(seed, epoch, next batch index), and a loader restored from that state yields exactly the batches the
uninterrupted run would have yielded. That is what makes resuming bitwise on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

DIGITS_SHAPE = (1, 8, 8)
DIGITS_CLASSES = 10


@dataclass
class Split:
    """Normalised train/test tensors; x: float32 [N, *shape], y: int64 [N]."""
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    name: str

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _check_fraction(test_fraction: float) -> None:
    if not isinstance(test_fraction, (int, float)) or not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction: must be a number in (0, 1), got {test_fraction!r}")


def _stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, test): every class keeps its share in both parts; same seed -> same split on
    every platform (numpy's PCG64 stream is specified, unlike the legacy global RNG)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), 0x5EED])))
    train, test = [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(len(idx) * test_fraction))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    train_idx, test_idx = np.concatenate(train), np.concatenate(test)
    # Mix the classes again so a loader without shuffling still sees a class mixture.
    return train_idx[rng.permutation(len(train_idx))], test_idx[rng.permutation(len(test_idx))]


def _standardise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Zero mean, unit variance with statistics of the TRAIN part only (no test leakage)."""
    mean = float(x_train.mean())
    std = float(x_train.std()) or 1.0
    return (x_train - mean) / std, (x_test - mean) / std


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's bundled 8x8 digits (1797 images, shipped inside the package: no download), as
    [N, 1, 8, 8] float32 images, standardised, with a deterministic stratified train/test split."""
    _check_fraction(test_fraction)
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the digits data set needs scikit-learn: pip install 'ncclavg[train]' "
                          "(or pass synthetic=True / --synthetic)") from e
    ds = _sk_load_digits()
    x = ds.images.astype(np.float32)  # [N, 8, 8], values 0..16
    y = ds.target.astype(np.int64)
    tr, te = _stratified_split(y, float(test_fraction), seed)
    x_tr, x_te = _standardise(x[tr], x[te])
    as_img = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).unsqueeze(1)  # noqa: E731
    return Split(as_img(x_tr), torch.from_numpy(y[tr]), as_img(x_te), torch.from_numpy(y[te]),
                 DIGITS_CLASSES, "digits")


def synthetic(num_samples: int = 8192, input_shape: Sequence[int] = DIGITS_SHAPE,
              num_classes: int = DIGITS_CLASSES, test_fraction: float = 0.2, seed: int = 0,
              noise: float = 1.0) -> Split:
    """Random data for throughput runs: Gaussian clusters (one random centre per class plus `noise`),
    so a model can still learn something and the accuracy column is not meaningless."""
    if not isinstance(num_samples, int) or num_samples < 2:
        raise ValueError(f"num_samples: need an integer >= 2, got {num_samples!r}")
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes: need an integer >= 2, got {num_classes!r}")
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"input_shape: need positive sizes, got {tuple(input_shape)!r}")
    _check_fraction(test_fraction)
    g = torch.Generator().manual_seed(int(seed))
    centres = torch.randn((num_classes, *shape), generator=g)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = centres[y] + float(noise) * torch.randn((num_samples, *shape), generator=g)
    n_test = max(1, int(round(num_samples * test_fraction)))
    n_test = min(n_test, num_samples - 1)
    return Split(x[n_test:].contiguous(), y[n_test:].contiguous(), x[:n_test].contiguous(),
                 y[:n_test].contiguous(), num_classes, "synthetic")


def check_sample_tensors(tensors: Sequence[Any], argname: str) -> int:
    """Checks that every entry is a tensor with a leading sample dimension, the same number of samples
    in each (a data set's columns, or one batch's inputs and target); returns that number."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{argname}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{argname}[{i}]: needs a leading sample dimension, got a scalar")
    n = tensors[0].shape[0]
    for i, t in enumerate(tensors[1:], 1):
        if t.shape[0] != n:
            raise ValueError(f"{argname}[{i}]: has {t.shape[0]} samples but {argname}[0] has {n}")
    return n


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch. See Note [Resumable shuffling]."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 0xDA7A])))
    return torch.from_numpy(rng.permutation(num_samples).astype(np.int64))


class TensorLoader:
    """Batches of in-memory tensors with seeded shuffling and a resumable position.

    Iterating yields the batches of the CURRENT epoch from the current batch index on, as tuples
    (one slice per tensor), and advances the position; when the epoch is exhausted the position moves to
    (epoch + 1, 0). `state_dict()` / `load_state_dict()` save and restore (seed, epoch, batch).
    """

    def __init__(self, *tensors: torch.Tensor, batch_size: int = 64, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        if not tensors:
            raise ValueError("tensors: need at least one tensor")
        n = check_sample_tensors(tensors, "tensors")
        if n == 0:
            raise ValueError("tensors: the data set is empty")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
        if drop_last and batch_size > n:
            raise ValueError(f"batch_size: {batch_size} exceeds the {n} samples and drop_last=True "
                             "would yield no batch")
        self.tensors = tuple(tensors)
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.batch = 0

    @property
    def num_samples(self) -> int:
        return int(self.tensors[0].shape[0])

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = self.num_samples, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def batch_sizes(self) -> list[int]:
        """Sizes of the batches of one epoch, in order (the last one may be smaller)."""
        n, b = self.num_samples, self.batch_size
        return [min(b, n - i * b) for i in range(len(self))]

    def _order(self, epoch: int) -> torch.Tensor | None:
        return epoch_permutation(self.num_samples, self.seed, epoch) if self.shuffle else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        order = self._order(self.epoch)
        while self.batch < len(self):
            lo = self.batch * self.batch_size
            hi = min(lo + self.batch_size, self.num_samples)
            if order is None:
                out = tuple(t[lo:hi] for t in self.tensors)
            else:
                idx = order[lo:hi]
                out = tuple(t.index_select(0, idx) for t in self.tensors)
            # Advance BEFORE yielding: a checkpoint taken while the consumer holds this batch (i.e.
            # after training on it) must point at the next one.
            self.batch += 1
            yield out
        self.epoch += 1
        self.batch = 0

    def batches(self, epoch: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """All batches of one epoch (default: the current one) WITHOUT moving the position: for
        evaluation passes over a loader that is also being trained on."""
        order = self._order(self.epoch if epoch is None else int(epoch))
        for i in range(len(self)):
            lo, hi = i * self.batch_size, min((i + 1) * self.batch_size, self.num_samples)
            yield tuple(t[lo:hi] if order is None else t.index_select(0, order[lo:hi]) for t in self.tensors)

    def set_position(self, epoch: int, batch: int = 0) -> None:
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch: must be a non-negative integer, got {epoch!r}")
        if not isinstance(batch, int) or not 0 <= batch <= len(self):
            raise ValueError(f"batch: must be in [0, {len(self)}], got {batch!r}")
        self.epoch, self.batch = epoch, batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "num_samples": self.num_samples, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position. The data set size and batch size must match the saved ones: a position
        in another batching of the data would silently train on a different sample order."""
        for key in ("num_samples", "batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(f"state: saved {key}={state[key]} but this loader has "
                                 f"{key}={getattr(self, key)}; the saved data position does not apply")
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.drop_last = bool(state.get("drop_last", self.drop_last))
        self.set_position(int(state["epoch"]), int(state["batch"]))
