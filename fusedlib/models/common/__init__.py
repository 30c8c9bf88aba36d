"""Parts shared by the models (Megatron-core's ``models/common``)."""
