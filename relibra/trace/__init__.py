"""Routing traces: the `.npz` format (format.py), importers from serving engines and Megatron, capture
from a Hugging Face model, and the synthetic generator."""
