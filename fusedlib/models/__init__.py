"""Megatron-core's ``models`` package: the model definitions built from fusedlib's parts."""
