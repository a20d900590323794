"""Small real data sets that ship with distrib, for examples and the `distrib train` job."""

from __future__ import annotations

from importlib import resources

import numpy as np

DIGITS_CLASSES = 10
DIGITS_TEST_EVERY = 5  # every 5th digit of each class is a test digit: an 80/20 split, stratified by class


def load_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 8x8 handwritten digits (UCI, 1,797 digits; see LICENSE-digits.txt), split 80/20 into train and test.

    The split is fixed and stratified, with no randomness: within each class, in file order, every 5th digit
    (the 5th, 10th, ...) is a test digit, which gives 1,442 training and 355 test digits. Features are the 64
    pixel counts scaled from 0..16 to [0, 1] as float32; labels are int64 class indices 0..9.

    Returns:
      (x_train, y_train, x_test, y_test), shapes (1442, 64), (1442,), (355, 64), (355,).

    Example:
      >>> from distrib.datasets import load_digits
      >>> x_train, y_train, x_test, y_test = load_digits()
      >>> x_train.shape, x_test.shape, x_train.dtype, int(y_train.max())
      ((1442, 64), (355, 64), dtype('float32'), 9)
    """
    with resources.files(__name__).joinpath("digits.npz").open("rb") as file, np.load(file) as data:
        features, labels = data["features"], data["labels"].astype(np.int64)
    x = features.astype(np.float32) / np.float32(16)
    is_test = _rank_within_class(labels) % DIGITS_TEST_EVERY == DIGITS_TEST_EVERY - 1
    return x[~is_test], labels[~is_test], x[is_test], labels[is_test]


def _rank_within_class(labels: np.ndarray) -> np.ndarray:
    """For each row, how many earlier rows have the same label."""
    rank = np.empty_like(labels)
    for label in range(DIGITS_CLASSES):
        rows = np.flatnonzero(labels == label)
        rank[rows] = np.arange(len(rows))
    return rank


__all__ = ["load_digits"]
