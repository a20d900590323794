"""Distributed input: input contexts, batch splitting, background prefetch and the distributed datasets."""

from distrib.input.batches import ArraySpec, split_bounds
from distrib.input.contexts import InputContext, InputWorkers, ValueContext
from distrib.input.datasets import DistributedDataset, DistributedDatasetsFromFunction, DistributedIterator, Optional

__all__ = ["ArraySpec", "DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator", "InputContext",
           "InputWorkers", "Optional", "ValueContext", "split_bounds"]
