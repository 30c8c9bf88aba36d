"""Optional backends: other libraries' kernels behind fusedlib's interfaces, used only
where they import (``fusedlib.backends.apex``)."""
