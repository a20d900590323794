"""distrib.experimental: TensorFlow's tf.distribute.experimental names (the partitioners)."""

from distrib.experimental import partitioners

__all__ = ["partitioners"]
