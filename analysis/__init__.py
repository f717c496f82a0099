"""Tables and figures from a results directory, beside the paper's numbers."""
