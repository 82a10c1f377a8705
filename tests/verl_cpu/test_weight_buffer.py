"""The CPU backend's weight sync through a shared buffer (setgrpo_verl/verl_cpu/weight_buffer.py).

What must hold: the weights the server loads are the actor's in the rollout's dtype, bit for bit as ``Tensor.to``
gives them; a second process sees what the first writes, also after the file's name is gone; every sync reaches the
server's parameters before the next rollout; a weight missing, unknown or of another shape is an error; a file
system without room is an error at creation that names the size.
"""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from setgrpo_verl.verl_cpu import weight_buffer
from setgrpo_verl.verl_cpu.rollout import TransformersRolloutAdapter, TransformersRolloutServer
from setgrpo_verl.verl_cpu.weight_buffer import Layout, WeightBuffer


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g)}


def test_the_buffer_holds_each_weight_as_tensor_to_gives_it(tmp_path):
    actor = _weights(0)
    layout = Layout.of([(n, tuple(t.shape)) for n, t in actor.items()], torch.bfloat16)
    assert layout.numel == 22 and layout.nbytes == 44
    writer = WeightBuffer.create(layout, tmp_path)
    for name, t in actor.items():
        writer.write(name, t)
    reader = WeightBuffer.open(writer.path, layout)
    writer.unlink()
    assert not writer.path.exists()
    for name, t in actor.items():
        assert torch.equal(reader.views[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))
    again = _weights(1)
    for name, t in again.items():  # the mapping is shared: the reader sees the writer's next sync without reopening
        writer.write(name, t)
    assert torch.equal(reader.views["a.weight"], again["a.weight"].to(torch.bfloat16))


def test_another_process_sees_the_writes_and_the_writer_sees_its_own(tmp_path):
    layout = Layout.of([("w", (4,))], torch.float32)
    buffer = WeightBuffer.create(layout, tmp_path)
    buffer.write("w", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    code = ("import sys, torch; from setgrpo_verl.verl_cpu.weight_buffer import Layout, WeightBuffer; "
            f"b = WeightBuffer.open(sys.argv[1], Layout.of([('w', (4,))], torch.float32)); "
            "print(b.views['w'].tolist()); b.views['w'][0] = -1.0")
    out = subprocess.run([sys.executable, "-c", code, str(buffer.path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[1.0, 2.0, 3.0, 4.0]"
    assert buffer.views["w"].tolist() == [-1.0, 2.0, 3.0, 4.0]


def test_a_weight_of_another_name_or_shape_is_an_error(tmp_path):
    buffer = WeightBuffer.create(Layout.of([("w", (2, 3))], torch.float32), tmp_path)
    with pytest.raises(KeyError, match="'v' is not in the rollout weight buffer"):
        buffer.write("v", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"'w': shape \(3, 2\), the buffer holds \(2, 3\)"):
        buffer.write("w", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="appears twice"):
        Layout.of([("w", (1,)), ("w", (1,))], torch.float32)
    with pytest.raises(ValueError, match="24 bytes, its layout needs 4"):
        WeightBuffer.open(buffer.path, Layout.of([("w", (1,))], torch.float32))


def test_no_room_for_the_buffer_is_an_error_at_creation_that_names_its_size(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weight_buffer.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"needs 4 MiB in .*No space left on device; free space there or set TMPDIR"):
        WeightBuffer.create(Layout.of([("w", (2**20,))], torch.float32), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_buffer_goes_to_shared_memory_only_where_it_has_room(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_buffer, "SHM_DIR", tmp_path)
    free = 2**30 + 1000
    monkeypatch.setattr(weight_buffer.os, "statvfs", lambda path: SimpleNamespace(f_bavail=free, f_frsize=1))
    assert weight_buffer._directory(400) == tmp_path
    assert weight_buffer._directory(400, keep_free=600) == tmp_path
    assert weight_buffer._directory(400, keep_free=700) != tmp_path  # Ray's object store keeps its room
    assert weight_buffer._directory(1001) != tmp_path  # the temporary directory instead


class _Remote:
    """A Ray actor handle's ``.remote`` over a local server."""

    def __init__(self, server):
        self.load_weights = SimpleNamespace(remote=server.load_weights)


def _adapter(server, dtype) -> TransformersRolloutAdapter:
    adapter = TransformersRolloutAdapter.__new__(TransformersRolloutAdapter)  # verl's rollout config is not needed
    adapter.dtype, adapter.is_leader, adapter.replica_rank = dtype, True, 0
    adapter._server, adapter._buffer = _Remote(server), None
    return adapter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_sync_reaches_the_servers_parameters_before_the_next_rollout(tiny_model, dtype):
    server = TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=4, seed=0, dtype=dtype)
    adapter = _adapter(server, dtype)
    names = [n for n, _ in server.model.named_parameters()]
    prompt = {"prompt_ids": [1, 5, 9], "sampling_params": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 2,
                                                            "logprobs": True}}
    for step in (1, 2):
        actor = {n: torch.randn(p.shape, dtype=torch.float32) * 0.02 for n, p in server.model.named_parameters()}
        asyncio.run(adapter.update_weights(iter(actor.items()), global_steps=step))
        assert server.version == step
        for n in names:
            assert torch.equal(dict(server.model.named_parameters())[n].detach(), actor[n].to(dtype)), (step, n)
        if step == 1:
            assert not adapter._buffer.path.exists()  # unlinked once both processes hold the mapping
        # the next rollout samples from exactly these weights: a fresh server loaded with them decodes the same
        fresh = TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=4, seed=0, dtype=dtype)
        fresh.model.load_state_dict({n: t.to(dtype) for n, t in actor.items()}, strict=False)
        fresh.version = step
        got = asyncio.run(server.generate(**prompt))
        want = asyncio.run(fresh.generate(**prompt))
        assert got.token_ids == want.token_ids and got.log_probs == want.log_probs
    with pytest.raises(RuntimeError, match="1 of the first sync's weights are missing"):
        asyncio.run(adapter.update_weights(iter(list(actor.items())[1:]), global_steps=3))
    with pytest.raises(KeyError, match="'extra.weight' is not in"):
        asyncio.run(adapter.update_weights(iter([("extra.weight", torch.zeros(1)), *actor.items()]), global_steps=3))


def test_a_first_sync_the_server_refuses_leaves_no_file_and_the_next_makes_a_new_buffer(tiny_model, monkeypatch):
    server = TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=4, seed=0)
    adapter = _adapter(server, torch.float32)
    actor = {n: p.detach().clone() for n, p in server.model.named_parameters()}
    monkeypatch.setattr(server, "_load", lambda state, steps: (_ for _ in ()).throw(RuntimeError("refused")))
    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(adapter.update_weights(iter(actor.items()), global_steps=1))
    assert adapter._buffer is None
    monkeypatch.undo()
    asyncio.run(adapter.update_weights(iter(actor.items()), global_steps=2))
    assert server.version == 2 and not adapter._buffer.path.exists()


def test_a_server_on_another_host_is_told_the_backend_runs_on_one(tiny_model, tmp_path):
    server = TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=4, seed=0)
    with pytest.raises(FileNotFoundError, match="trainer.nnodes=1.*restarted after the first weight sync"):
        asyncio.run(server.load_weights(str(tmp_path / "gone"), Layout.of([("w", (1,))], torch.float32), 1))


def sharded_sync_rank(rank: int, world: int) -> dict:
    """One rank of :func:`test_sharded_weights_reach_the_buffer_whole_from_the_replicas_leader`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    loaded = {}

    async def load_weights(path, layout, global_steps=None):  # the server maps the buffer at the first sync
        if "buffer" not in loaded:
            loaded["buffer"] = WeightBuffer.open(path, layout)
        loaded["step"] = global_steps

    adapter = _adapter(SimpleNamespace(load_weights=load_weights), torch.bfloat16)
    adapter.is_leader = rank == 0
    result = {}
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # each rank changes its own shard
        asyncio.run(adapter.update_weights(iter(model.state_dict().items()), global_steps=step))
        full = {n: t.full_tensor() for n, t in model.state_dict().items()}
        if rank == 0:
            result[f"whole at step {step}"] = loaded["step"] == step and all(
                torch.equal(loaded["buffer"].views[n], t.to(torch.bfloat16)) for n, t in full.items())
    # a weight the first sync did not have: the leader raises only after every gather, so no rank is left waiting
    renamed = [(("renamed." + n) if i == 0 else n, t) for i, (n, t) in enumerate(model.state_dict().items())]
    try:
        asyncio.run(adapter.update_weights(iter(renamed), global_steps=3))
        result["renamed"] = "accepted"
    except KeyError as err:
        result["renamed"] = "KeyError" if "renamed." in str(err) else str(err)
    result["in step after the error"] = all(t.full_tensor().numel() > 0 for t in model.state_dict().values())
    result["buffer"] = adapter._buffer is not None
    result["ok"] = result["buffer"] == (rank == 0) and result["in step after the error"] and (
        rank != 0 or (result["renamed"] == "KeyError" and result["whole at step 1"] and result["whole at step 2"]))
    return result


def test_sharded_weights_reach_the_buffer_whole_from_the_replicas_leader(tmp_path):
    """Two gloo ranks holding FSDP2 shards: both take part in every gather, the leader alone writes the whole
    weights, and the server's mapping sees each step's; a weight the leader refuses stops it only after the gathers."""
    from tests.gloo_ranks import run_two_gloo_ranks

    results, proc = run_two_gloo_ranks(f"{__name__}:sharded_sync_rank", tmp_path, timeout=300)
    assert proc.returncode == 0, [r.get("traceback") for r in results]
    assert results[0]["whole at step 1"] and results[0]["whole at step 2"] and results[0]["buffer"]
    assert results[0]["renamed"] == "KeyError" and results[1]["renamed"] == "accepted"
    assert results[1]["buffer"] is False


class _FailingShard:
    """A DTensor-like shard whose gather fails (a rank lost mid-sync)."""

    def __init__(self, shape):
        self.shape = torch.Size(shape)

    def full_tensor(self):
        raise RuntimeError("gloo: Connection closed by peer")


def test_a_first_sync_that_fails_while_writing_leaves_no_file(tiny_model, tmp_path, monkeypatch):
    """The buffer's file is the whole model in shared memory: a first sync that fails after creating it (here in a
    gather while writing) removes it and forgets it, and the next sync makes a new one (review D3)."""
    monkeypatch.setattr(weight_buffer, "SHM_DIR", tmp_path)
    server = TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=4, seed=0)
    adapter = _adapter(server, torch.float32)
    actor = {n: p.detach().clone() for n, p in server.model.named_parameters()}
    name, last = list(actor.items())[-1]
    with pytest.raises(RuntimeError, match="Connection closed"):
        asyncio.run(adapter.update_weights(iter([*list(actor.items())[:-1], (name, _FailingShard(last.shape))]),
                                           global_steps=1))
    assert adapter._buffer is None and not list(tmp_path.glob("setgrpo-rollout-weights-*"))
    asyncio.run(adapter.update_weights(iter(actor.items()), global_steps=2))
    assert server.version == 2 and not list(tmp_path.glob("setgrpo-rollout-weights-*"))


def test_a_new_buffer_removes_the_files_of_writers_that_no_longer_exist(tmp_path):
    """A writer killed between creating its buffer and the server mapping it cannot remove the file: the next
    buffer made on the host removes it (its process id names no live process), and leaves a live writer's alone."""
    import os

    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True, check=True).stdout)
    stale = tmp_path / f"setgrpo-rollout-weights-{pid}-0123"
    stale.write_bytes(b"\0" * 4096)
    live = tmp_path / f"setgrpo-rollout-weights-{os.getpid()}-4567"
    live.write_bytes(b"\0")
    other = tmp_path / f"setgrpo-rollout-weights-notapid-89ab"
    other.write_bytes(b"\0")
    buffer = WeightBuffer.create(Layout.of([("a", (2,))], torch.float32), directory=tmp_path)
    assert not stale.exists() and live.exists() and other.exists() and buffer.path.exists()
    buffer.unlink()
