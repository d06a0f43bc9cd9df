"""Tensor parallelism: a model's weights split across ranks (`sharding.py`) that sum their partial
results through a communicator (`groups.py`)."""
