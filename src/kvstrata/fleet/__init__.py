"""The fleet: router front door, worker processes and the event plane (``kvstrata up``)."""
