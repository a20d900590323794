"""The digits MLP that `distrib train` and examples/train_mlp.py train: forward and backward written out in `xp`."""

from __future__ import annotations

import numpy as np

from distrib.variables import Variable


class MLP:
    """64 -> hidden -> 10 with ReLU and softmax cross-entropy; forward and backward written out in `xp`.

    Weights are float32 distrib.Variables (create the model under `strategy.scope()`); the forward and backward
    passes run in `dtype` (float32, or float16/bfloat16 for mixed precision), the loss in float32.
    """

    def __init__(self, xp, features: int, hidden: int, classes: int, seed: int):
        self.xp = xp
        rng = np.random.default_rng(seed)

        def he_normal(fan_in: int, fan_out: int) -> np.ndarray:
            return rng.normal(0.0, np.sqrt(2.0 / fan_in), size=(fan_in, fan_out)).astype(np.float32)

        self.variables = {
            "hidden_kernel": Variable(he_normal(features, hidden), name="hidden/kernel"),
            "hidden_bias": Variable(np.zeros(hidden, np.float32), name="hidden/bias"),
            "output_kernel": Variable(he_normal(hidden, classes), name="output/kernel"),
            "output_bias": Variable(np.zeros(classes, np.float32), name="output/bias"),
        }

    def _weights(self, dtype) -> tuple:
        return tuple(v.read_value().astype(dtype, copy=False) for v in self.variables.values())

    def logits(self, x, dtype):
        """Class scores (float32) for a batch of rows."""
        w1, b1, w2, b2 = self._weights(dtype)
        hidden = self.xp.maximum(x.astype(dtype, copy=False) @ w1 + b1, 0)
        return (hidden @ w2 + b2).astype(self.xp.float32)

    def loss_and_gradients(self, x, y, dtype) -> tuple:
        """The mean cross-entropy over this batch, and its float32 gradients in the order of `variables`."""
        # overflow and NaN pass silently: the training loop stops at a non-finite loss in one line naming the step,
        # which NumPy's warnings would only precede
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return self._loss_and_gradients(x, y, dtype)

    def _loss_and_gradients(self, x, y, dtype) -> tuple:
        xp = self.xp
        w1, b1, w2, b2 = self._weights(dtype)
        x = x.astype(dtype, copy=False)
        pre_activation = x @ w1 + b1
        hidden = xp.maximum(pre_activation, 0)
        logits = (hidden @ w2 + b2).astype(xp.float32)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        rows = xp.arange(len(y))
        loss = -log_probs[rows, y].mean()

        d_logits = xp.exp(log_probs)  # softmax - one_hot, over the batch size: the gradient of the mean loss
        d_logits[rows, y] -= 1
        d_logits = (d_logits / len(y)).astype(dtype)
        d_hidden = (d_logits @ w2.T) * (pre_activation > 0)
        grads = (x.T @ d_hidden, d_hidden.sum(axis=0), hidden.T @ d_logits, d_logits.sum(axis=0))
        return loss, [g.astype(xp.float32) for g in grads]
