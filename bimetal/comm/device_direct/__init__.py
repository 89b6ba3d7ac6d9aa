"""Device-direct transport: cross-vendor point-to-point through an RDMA transfer engine, CPU-offloaded control.

Registered as ``bimetal_device_direct`` (``bimetal.comm.registry``); this package only re-exports. Its files:

* ``creator.py``: the back-end creator (engine start-up agreement, the fallback to cpu-forward); ``builds.py``:
  the installed engine wheel against torch's build; ``probe.py``: the start-up probe write between every pair;
* ``options.py``: ``DeviceDirectOptions`` (``pg_options``, else ``BIMETAL_DD_*``, else defaults) and the
  resolved ``DeviceDirectSettings``;
* ``pg.py``: the process group (point-to-point, and the few collectives a pp group runs, over it);
* ``proxy.py``: the proxy thread's event loop; ``transfers.py``: the inline / eager / rendezvous wire
  protocols it drives; ``ops.py``: an operation and its states; ``credits.py``, ``pacing.py``: receive-slot
  credits and poll pacing; ``notes.py``: validation of the notes and start-up records peers exchange;
* ``control.py``: the control channel (persistent TCP connections, hardened listener);
* ``engine.py``: the transfer-engine interface and protocol choice; ``engine_env.py``: the environment the engine
  starts in (``MC_FORCE_TCP``, ``MC_GID_INDEX``, the ROCm build's HIP transport); ``gids.py``: whether the RoCE GID
  it uses routes between nodes; ``mooncake.py``: the Mooncake adapter;
  ``locations.py``: the engine's names for memory locations; ``registrations.py``: memory registered once (the
  group's buffers), cached (receive tensors) or copied into a registered send pool.

Options (``DeviceDirectOptions`` or a dict of its fields as ``pg_options``, else env): ``host`` /
``BIMETAL_DD_HOST``, ``protocol`` / ``BIMETAL_DD_PROTOCOL``, ``engine`` / ``BIMETAL_DD_ENGINE``, ``chunk_bytes`` /
``BIMETAL_DD_CHUNK_BYTES``, ``slots`` / ``BIMETAL_DD_SLOTS``, ``window`` / ``BIMETAL_DD_WINDOW``, ``inline_bytes``
/ ``BIMETAL_DD_INLINE_BYTES``, ``fallback`` / ``BIMETAL_DD_FALLBACK``, ``device`` / ``BIMETAL_DD_DEVICE``, ``devices``
/ ``BIMETAL_DD_DEVICES``, ``reg_cache_bytes`` / ``BIMETAL_DD_REG_CACHE_BYTES``, ``gid_index`` /
``BIMETAL_DD_GID_INDEX``, ``allowed_interfaces`` (``parallel.interfaces``, else ``BIMETAL_IFACES``). The host
defaults to this rank's own interface among those the group's members agree on (``bimetal.topology.reach``:
candidates sharing a subnet with the peers, local rank i taking the i-th), proven reachable by every member before
the engine starts.
"""

from __future__ import annotations

from bimetal.comm.device_direct.creator import create_process_group
from bimetal.comm.device_direct.engine import EngineUnavailableError
from bimetal.comm.device_direct.options import DeviceDirectOptions, DeviceDirectSettings, default_host, options_from
from bimetal.comm.device_direct.pg import DeviceDirectProcessGroup

__all__ = ["DeviceDirectOptions", "DeviceDirectProcessGroup", "DeviceDirectSettings", "EngineUnavailableError",
           "create_process_group", "default_host", "options_from"]
