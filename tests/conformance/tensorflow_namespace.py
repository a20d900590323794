"""A `distrib`-like namespace backed by tf.distribute, so that a conformance case runs unchanged on TensorFlow."""

from __future__ import annotations

import types

import numpy as np

LOGICAL_CPUS = 4


def build(tf) -> types.SimpleNamespace:
    """The namespace a case receives as `distrib`; call it before TensorFlow runs its first operation.

    The host CPU is split into 4 logical devices (`/cpu:0` ... `/cpu:3`), and NumPy behaviour is turned on for
    tensors (with `.sum()` added), so a case may call `.sum()` or `.mean()` on what a variable reads, as it does
    on distrib's arrays.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)
    tf.experimental.numpy.experimental_enable_numpy_behavior()
    if not hasattr(tf.Tensor, "sum"):  # NumPy behaviour gives tensors .mean() but not .sum()
        tf.Tensor.sum = lambda self, axis=None, keepdims=False: tf.experimental.numpy.sum(self, axis, keepdims=keepdims)

    class MirroredStrategy(tf.distribute.MirroredStrategy):
        """tf.distribute.MirroredStrategy over "CPU:i" names that takes datasets as lists of NumPy batches."""

        def __init__(self, devices=None, cross_device_ops=None):
            names = [f"/cpu:{str(d).rsplit(':', 1)[1]}" for d in (devices or ["CPU:0"])]
            super().__init__(names, cross_device_ops=cross_device_ops)

        def experimental_distribute_values_from_function(self, value_fn):
            return super().experimental_distribute_values_from_function(lambda ctx: _tensors(tf, value_fn(ctx)))

        def experimental_distribute_dataset(self, dataset, options=None):
            return super().experimental_distribute_dataset(_as_dataset(tf, dataset), options)

        def distribute_datasets_from_function(self, dataset_fn, options=None):
            return super().distribute_datasets_from_function(lambda ctx: _as_dataset(tf, dataset_fn(ctx)), options)

    return types.SimpleNamespace(
        MirroredStrategy=MirroredStrategy,
        Variable=tf.Variable,
        ReduceOp=tf.distribute.ReduceOp,
        VariableAggregation=tf.VariableAggregation,
        VariableSynchronization=tf.VariableSynchronization,
        CommunicationOptions=tf.distribute.experimental.CommunicationOptions,
        get_replica_context=lambda: _replica_context(tf),
        get_strategy=tf.distribute.get_strategy,
        has_strategy=tf.distribute.has_strategy,
        in_cross_replica_context=tf.distribute.in_cross_replica_context,
    )


def _as_dataset(tf, batches):
    """A list (or generator) of NumPy batches as the tf.data pipeline a TensorFlow user writes for it.

    Batches of one size, the last possibly shorter, become `from_tensor_slices(rows).batch(size)`; any other
    list is served by a generator with an unknown batch dimension.
    """
    if isinstance(batches, tf.data.Dataset):
        return batches
    batches = [np.asarray(b) for b in batches]
    size = len(batches[0])
    if all(len(b) == size for b in batches[:-1]) and len(batches[-1]) <= size:
        return tf.data.Dataset.from_tensor_slices(np.concatenate(batches)).batch(size)
    spec = tf.TensorSpec((None,) + batches[0].shape[1:], tf.as_dtype(batches[0].dtype))
    return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)


def _replica_context(tf):
    """tf.distribute.get_replica_context(), whose collectives take NumPy arrays as tensors."""
    ctx = tf.distribute.get_replica_context()
    return None if ctx is None else _TensorArguments(tf, ctx)


class _TensorArguments:
    """A ReplicaContext whose all_reduce and all_gather convert NumPy leaves to tensors."""

    def __init__(self, tf, ctx):
        self._tf, self._ctx = tf, ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def all_reduce(self, reduce_op, value, options=None):
        return self._ctx.all_reduce(reduce_op, _tensors(self._tf, value), options=options)

    def all_gather(self, value, axis, options=None):
        return self._ctx.all_gather(_tensors(self._tf, value), axis, options=options)


def _tensors(tf, value):
    """`value` with its NumPy leaves as tensors, as a TensorFlow user's program holds them (TensorFlow's
    collectives pack values by `.shape.num_elements()`, which a NumPy array lacks)."""
    return tf.nest.map_structure(lambda v: tf.convert_to_tensor(v) if isinstance(v, (np.ndarray, np.generic)) else v,
                                 value)
