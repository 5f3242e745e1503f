"""What a window publishes for `PseudoBatchLogger`, on every backend.

Each backend's window state keeps rings of the last closed windows (their
loss, samples, update, micro-batches and noise-scale estimates) and a count
of those published; the callback reads them between steps. Kept apart from
the backends' modules so that the callback imports no backend.
"""

# Updates remembered for `PseudoBatchLogger` between two reads.
LOG_CAPACITY = 256
