"""Collectives: the pure packing planner and the cross-device ops that execute its plans on a backend."""
