"""ReLibra: routing-replay-guided load balancing for MoE training in RL.

Pipeline (see README): RoutingTrace -> SampleCounts -> Workload -> planners -> executors -> results.
"""

__version__ = "0.1.0"
