"""Megatron-core integration (``pip install .[megatron]``): routing replay into ``MoELayer`` with ReLibra's
placement and replication applied (see docs/megatron.md).

Importing this package does not import megatron-core; the submodules do when used.
"""
