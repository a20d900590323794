"""distrib.experimental: TensorFlow's tf.distribute.experimental names (the partitioners, and the communication
options TensorFlow keeps there), so that code written for TensorFlow finds them where it looks."""

from distrib.experimental import partitioners
from distrib.options import CommunicationImplementation, CommunicationOptions

__all__ = ["CommunicationImplementation", "CommunicationOptions", "partitioners"]
