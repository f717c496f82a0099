"""ReLibra planners: inter-batch reordering, intra-batch replication, exact references."""
