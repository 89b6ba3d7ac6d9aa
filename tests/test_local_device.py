"""Each rank on its own GPU, chosen as the launcher and the visibility variables say, and every buffer, stream
and pool of both transports on that GPU: checked on ``FakeCudaDevices`` (a node of 8 GPUs, see fake_cuda.py)."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
import torch
from fake_cuda import FakeCudaDevices

from bimetal.errors import UserError
from bimetal.topology.local_device import bind_rank_device, rank_device

pytestmark = pytest.mark.timeout(60)
LAUNCH_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "BIMETAL_SIMULATE", "BIMETAL_VENDOR", "BIMETAL_SIMULATE_DEVICE",
               "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeCudaDevices, pytest.MonkeyPatch]:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return FakeCudaDevices(8).install(monkeypatch), monkeypatch


def test_the_launcher_and_the_visibility_variables_choose_the_gpu(node) -> None:
    fake, env = node
    env.setenv("LOCAL_RANK", "5")
    assert bind_rank_device() == torch.device("cuda", 5) and fake.set_calls == [5]
    env.delenv("LOCAL_RANK")
    env.setenv("SLURM_LOCALID", "3")  # srun without torchrun
    assert rank_device() == torch.device("cuda", 3)
    fake.count = 1  # Slurm --gpus-per-task=1 (or a per-rank CUDA_VISIBLE_DEVICES): the task's one GPU is 0
    env.setenv("CUDA_VISIBLE_DEVICES", "GPU-5e1f")
    assert rank_device() == torch.device("cuda", 0)
    fake.count = 2
    env.setenv("LOCAL_RANK", "3")
    env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError) as caught:
        bind_rank_device()
    text = str(caught.value)
    assert text.startswith("LOCAL_RANK=3 has no GPU of its own: this process sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1)")
    assert "\n" not in text
    env.setenv("LOCAL_RANK", "three")
    with pytest.raises(UserError, match="LOCAL_RANK='three' is not a local rank"):
        rank_device()


def test_simulation_keeps_its_devices(node) -> None:
    fake, env = node
    env.setenv("LOCAL_RANK", "1")
    env.setenv("BIMETAL_SIMULATE", "nvidia:1,amd:1")
    assert rank_device() == torch.device("cpu")
    env.setenv("BIMETAL_SIMULATE_DEVICE", "cuda")  # the GPU check: simulated vendors share GPU 0
    assert bind_rank_device() == torch.device("cuda", 0) and fake.set_calls == [0]


def test_every_buffer_stream_and_pool_is_on_the_ranks_own_gpu(node) -> None:
    """Eight local ranks in turn, each after ``bind_rank_device`` (as the trainer does before any group): its
    topology record, device-direct receive slots and copy stream, and cpu-forward's pinned pool and copy streams
    all name its own GPU; nothing lands on GPU 0 for rank k > 0."""
    from bimetal.comm.cpu_forward.pg import CpuForwardProcessGroup
    from bimetal.comm.device_direct.engine import Engine
    from bimetal.comm.device_direct.options import DeviceDirectSettings
    from bimetal.comm.device_direct.proxy import Proxy
    from bimetal.comm.striping import CpuForwardOptions
    from bimetal.topology.exchange import local_record

    fake, env = node
    for k in range(8):
        env.setenv("LOCAL_RANK", str(k))
        fake.current = 0  # a new process: its threads start on GPU 0
        fake.allocated_on.clear(), fake.pinned_on.clear(), fake.streams.clear()
        assert bind_rank_device() == torch.device("cuda", k)
        record = local_record(rank=k)
        assert (record.device_index, record.device) == (k, "FAKE GPU 80GB")
        fake.current = 0  # what a proxy or worker thread sees: the device is per thread
        recording_engine = mock.create_autospec(Engine, instance=True)  # stands in for Mooncake
        recording_engine.needs_source_registration = True  # RDMA, as on a real cluster: a registered send pool too
        proxy = Proxy(recording_engine, 0, [0, 1], chunk=1024, slots=2, host="127.0.0.1",
                      device=DeviceDirectSettings(host="127.0.0.1").torch_device())
        try:
            proxy.add_peer(1)
        finally:
            proxy.close()
        pg = CpuForwardProcessGroup([mock.MagicMock()], 0, 2, timedelta(seconds=5),
                                    CpuForwardOptions(stripes=1, chunk_bytes=4096, pool_buffers=2).resolved())
        try:
            pg.state.pool.give(pg.state.pool.take(torch.uint8, 64, timedelta(seconds=1)))
            pg.state.streams.pair(torch.device("cuda", k))
        finally:
            pg.shutdown()
        assert pg.state.device == torch.device("cuda", k)
        assert fake.allocated_on == [k, k], "device-direct send pool and receive slots"
        assert fake.pinned_on == [k], "cpu-forward's pinned staging pool"
        assert [s.device for s in fake.streams] == [torch.device("cuda", k)] * 3, "dd copy stream, cf copy streams"
        assert recording_engine.register.call_count == 2  # the send pool and the receive slots, once each
