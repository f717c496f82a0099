"""The cost model: per-layer compute and communication (model.py), the one rail-optimized fabric
(fabric.py), link rates (linkrates.py), overlap, migration and replica-buffer memory."""
