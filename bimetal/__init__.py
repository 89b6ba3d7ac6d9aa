"""bimetal: one torch.distributed job across AMD (ROCm) and NVIDIA (CUDA) GPUs.

Importing bimetal registers its torch.distributed back-ends (``bimetal_cpu_forward``,
``bimetal_device_direct``, and the simulated native back-end ``bimetal_sim_native``) and changes
nothing else in torch.
"""

from bimetal.comm import registry as _registry
from bimetal.version import __version__

_registry.register_backends()

__all__ = ["__version__"]
