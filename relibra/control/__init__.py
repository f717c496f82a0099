"""The control plane: planning tasks per batch and layer, worker processes, deadlines and fallbacks."""
