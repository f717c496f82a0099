"""Load-balancing baselines the paper compares against: one short pure module each."""
