"""The HF writer lays files out first and writes tensors as they come: the files are byte for byte safetensors'
own serialisation (what the writer wrote before it streamed), from host tensors and through pinned GPU staging."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from lightning_megatron import staged_write
from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.hf_io import TensorSpec, plan_parallel_shards, safetensors_layout, write_safetensors
from lightning_megatron.options import ModelOptions
from lightning_megatron.staged_write import FileLayout, StagedWriter, write_host_tensors
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint


def _tensors(device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {  # odd byte counts next to wider dtypes, an empty tensor, a scalar, one of several chunks
        "a.bf16_odd": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "b.fp32": torch.randn(7, 9, generator=generator),
        "c.int64": torch.arange(11),
        "d.bool": torch.tensor([True, False, True]),
        "e.empty": torch.empty(0, 4),
        "f.scalar": torch.tensor(2.5, dtype=torch.float16),
        "g.large_fp32": torch.randn(64, 64, generator=generator),
        "h.transposed": torch.randn(8, 6, generator=generator).t(),  # not contiguous
    }
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def _library_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({name: tensor.cpu().contiguous() for name, tensor in tensors.items()}, metadata={"format": "pt"})


def _write_out_of_order(path: Path, tensors: dict[str, torch.Tensor], **options: int) -> None:
    layout = safetensors_layout(TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items())
    with StagedWriter({path: layout}, **options) as writer:
        for name in reversed(list(tensors)):  # an export's order is not the file's
            writer.write(name, tensors[name])


def test_a_file_written_out_of_order_in_small_chunks_is_safetensors_own_bytes(tmp_path):
    tensors = _tensors()
    _write_out_of_order(tmp_path / "model.safetensors", tensors, chunk_bytes=40, threads=2)
    assert (tmp_path / "model.safetensors").read_bytes() == _library_bytes(tensors)


def test_a_file_of_exactly_the_layouts_size_is_written_in_place_and_any_other_is_truncated_first(tmp_path,
                                                                                                 monkeypatch):
    """A preallocated file is opened without truncation (it keeps its allocated pages) and still ends as
    safetensors' own bytes; one of another size, or under a layout with a gap (a byte the write would not cover),
    is truncated as before."""
    truncated: dict[str, bool] = {}
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *mode: truncated.__setitem__(Path(path).name, bool(
        flags & os.O_TRUNC)) or real_open(path, flags, *mode))
    tensors = _tensors()
    layout = safetensors_layout(TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items())
    size = layout.tiled_size()
    assert size == len(_library_bytes(tensors))
    for name, existing, truncates in (("exact", size, False), ("longer", size + 7, True), ("new", None, True)):
        path = tmp_path / f"{name}.safetensors"
        if existing is not None:
            path.write_bytes(b"\xff" * existing)  # stale bytes: all of them must be gone
        _write_out_of_order(path, tensors, chunk_bytes=40, threads=1)
        assert path.read_bytes() == _library_bytes(tensors), name
        assert truncated[path.name] is truncates, name
    gapped = FileLayout(b"head", {"x": (8, 4)})  # bytes 4..7 are nobody's
    assert gapped.tiled_size() is None
    (tmp_path / "gapped").write_bytes(b"\xff" * 12)
    os.close(staged_write.create_file(tmp_path / "gapped", gapped))
    assert (tmp_path / "gapped").read_bytes() == b"head"


def test_host_tensors_written_at_once_are_safetensors_own_bytes_and_a_wrong_tensor_is_refused(tmp_path):
    tensors = _tensors()
    layout = safetensors_layout(TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items())
    write_host_tensors(tmp_path / "model.safetensors", layout, tensors)
    assert (tmp_path / "model.safetensors").read_bytes() == _library_bytes(tensors)
    with pytest.raises(ValueError, match=r"b.fp32: \(7, 8\) torch.float32 on cpu is not the 252 host bytes"):
        write_host_tensors(tmp_path / "wrong.safetensors", layout, {**tensors, "b.fp32": torch.zeros(7, 8)})


def test_sharded_files_are_safetensors_own_bytes(tmp_path):
    tensors = _tensors()
    write_safetensors(tmp_path, tensors, shard_bytes=256)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(tensor.nbytes for tensor in tensors.values())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3
    for file in files:
        assert (tmp_path / file).read_bytes() == _library_bytes(load_file(tmp_path / file)), file


def test_tensors_for_parallel_files_are_spread_over_them_by_bytes():
    """A delta's few tensors go into as many files as threads write at once, each file about the same bytes (the
    largest first onto the lightest), in name order within a file; no more files than tensors, and more than the
    threads only where a file would pass the shard size."""
    sizes = {"mtp.a": 900, "mtp.b": 500, "mtp.c": 400, "mtp.d": 300, "mtp.e": 200, "mtp.f": 100}
    shards = plan_parallel_shards(sizes, files=3, shard_bytes=10_000)
    assert shards == [["mtp.a"], ["mtp.b", "mtp.e", "mtp.f"], ["mtp.c", "mtp.d"]]
    loads = [sum(sizes[name] for name in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert plan_parallel_shards(sizes, files=8, shard_bytes=10_000) == [[name] for name in sorted(sizes)]
    # 2400 bytes in files of 600: four files, none over 600 but the one of a larger tensor alone
    assert plan_parallel_shards(sizes, files=2, shard_bytes=600) == [["mtp.a"], ["mtp.b"], ["mtp.c", "mtp.f"],
                                                                     ["mtp.d", "mtp.e"]]
    assert plan_parallel_shards({"only": 5}, files=8) == [["only"]]


def test_a_failed_file_raises_at_close_not_before_and_a_missing_tensor_is_named(tmp_path):
    tensors = _tensors()
    layout = safetensors_layout(TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items())
    writer = StagedWriter({tmp_path / "no such folder" / "model.safetensors": layout})
    for name, tensor in tensors.items():
        writer.write(name, tensor)  # every rank must keep iterating the export: nothing raises here
    with pytest.raises(FileNotFoundError):
        writer.close()

    writer = StagedWriter({tmp_path / "model.safetensors": layout})
    writer.write("b.fp32", tensors["b.fp32"])
    with pytest.raises(ValueError, match="never written.*a.bf16_odd"):
        writer.close()


@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
def test_a_round_trip_export_is_the_source_file_byte_for_byte(model_parallel, tmp_path, bridge_type):
    source = make_tiny_checkpoint(tmp_path / "source", "qwen3")  # written by safetensors itself
    bridge = create_bridge(bridge_type, source)
    exported = bridge.save_hf(bridge.build(ModelOptions()), tmp_path / "export")
    assert (exported / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_an_export_failing_mid_way_leaves_nothing(model_parallel, tmp_path):
    from lightning_megatron.bridges.mbridge import MBridge

    class FailsHalfWay(MBridge):
        def export_hf_weights(self, chunks, **options):
            for index, (name, tensor) in enumerate(super().export_hf_weights(chunks, **options)):
                if index == 3:
                    raise BridgeError("the gather failed")
                yield name, tensor

    bridge = FailsHalfWay(make_tiny_checkpoint(tmp_path / "source", "qwen3"))
    with pytest.raises(BridgeError, match="save_hf: the gather failed; nothing was written"):
        bridge.save_hf(bridge.build(ModelOptions()), tmp_path / "out" / "export")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.gpu
def test_gpu_tensors_through_pinned_staging_give_the_same_bytes(tmp_path):
    tensors = _tensors("cuda")
    # small chunks: each of the two pinned buffers is reused many times while the other's chunk is written
    _write_out_of_order(tmp_path / "model.safetensors", tensors, chunk_bytes=64, threads=2)
    assert (tmp_path / "model.safetensors").read_bytes() == _library_bytes(tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
def test_gpu_model_export_is_the_source_file_byte_for_byte(model_parallel, tmp_path, bridge_type):
    source = make_tiny_checkpoint(tmp_path / "source", "qwen3")
    bridge = create_bridge(bridge_type, source)
    chunks = bridge.build(ModelOptions())
    assert next(chunks[0].parameters()).is_cuda
    exported = bridge.save_hf(chunks, tmp_path / "export")
    assert (exported / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def _instrument_writes(monkeypatch, before_write) -> list[tuple[str, int]]:
    """Record every tensor write (file name, offset) in the order the real writes happen; `before_write(file name)`
    runs first (to hold a file's writes back). The header, written at offset 0, is not a tensor write."""
    writes: list[tuple[str, int]] = []
    real_write_all = staged_write._write_all

    def write_all(descriptor: int, data: memoryview, offset: int) -> None:
        if offset:
            file = Path(os.readlink(f"/proc/self/fd/{descriptor}")).name
            before_write(file)
            writes.append((file, offset))
        real_write_all(descriptor, data, offset)

    monkeypatch.setattr(staged_write, "_write_all", write_all)
    return writes


def _two_files(tensors: dict[str, torch.Tensor], split: int) -> dict[str, tuple[list[str], FileLayout]]:
    names = list(tensors)
    return {file: (part, safetensors_layout(TensorSpec(n, tuple(tensors[n].shape), tensors[n].dtype) for n in part))
            for file, part in (("1.safetensors", names[:split]), ("2.safetensors", names[split:]))}


@pytest.mark.gpu
def test_gpu_files_are_written_at_the_same_time_although_the_export_feeds_them_in_turn(tmp_path, monkeypatch):
    # the export's order: every tensor of the first file, then the second's; the first file's writes are held
    # back until the second file has been written to, which a writer feeding the files in turn never does
    tensors = {f"layer.{index:02d}": torch.randn(256, 1024, device="cuda") for index in range(8)}
    second_file_written = threading.Event()

    def hold_the_first_file(file: str) -> None:
        if file == "2.safetensors":
            second_file_written.set()
        else:
            assert second_file_written.wait(timeout=60), "the second file was not written while the first was held back"

    writes = _instrument_writes(monkeypatch, hold_the_first_file)
    files = _two_files(tensors, split=6)
    layouts = {tmp_path / file: layout for file, (_, layout) in files.items()}
    with StagedWriter(layouts, chunk_bytes=64 * 1024) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    first_file = [index for index, (file, _) in enumerate(writes) if file == "1.safetensors"]
    assert min(index for index, (file, _) in enumerate(writes) if file == "2.safetensors") < first_file[-1]
    for file, (names, _) in files.items():
        assert (tmp_path / file).read_bytes() == _library_bytes({name: tensors[name] for name in names})


@pytest.mark.gpu
def test_gpu_tensors_made_for_the_writer_hold_no_more_device_memory_than_its_budget(tmp_path, monkeypatch):
    tensor_bytes, budget = 1024**2, 4 * 1024**2
    _instrument_writes(monkeypatch, lambda file: time.sleep(0.01))  # slow files: the export could run far ahead
    shapes = {f"layer.{index:02d}": (256, 1024) for index in range(32)}  # fp32: 1 MiB each
    layout = safetensors_layout(TensorSpec(name, shape, torch.float32) for name, shape in shapes.items())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    expected = {}
    with StagedWriter({tmp_path / "model.safetensors": layout}, chunk_bytes=256 * 1024,
                      device_budget_bytes=budget) as writer:
        for index, name in enumerate(shapes):
            made = torch.full(shapes[name], float(index), device="cuda")  # made by the export, as a gather is
            expected[name] = made.cpu()
            writer.write(name, made)
            del made
    assert torch.cuda.max_memory_allocated() - before <= budget + 2 * tensor_bytes
    assert (tmp_path / "model.safetensors").read_bytes() == _library_bytes(expected)


@pytest.mark.gpu
def test_gpu_small_tensors_that_follow_each_other_in_the_file_share_chunks(tmp_path, monkeypatch):
    # a LoRA adapter's export: hundreds of small tensors in the file's order; the writer's first write is held
    # until the export has handed every tensor over, so the rest wait in its queue and are written a chunk at once
    tensors = {f"adapter.{index:03d}": torch.randn(1024, device="cuda") for index in range(200)}  # 4 KiB each
    handed_over = threading.Event()
    writes = _instrument_writes(monkeypatch, lambda file: handed_over.wait(timeout=60))
    layout = safetensors_layout(TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items())
    chunk_bytes = 64 * 1024
    with StagedWriter({tmp_path / "adapter.safetensors": layout}, chunk_bytes=chunk_bytes) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        handed_over.set()
    # the tensors the thread took before its first write was held, then the rest's bytes in whole chunks
    assert len(writes) <= 2 + 199 * 4096 // chunk_bytes + 1 < len(tensors)
    assert (tmp_path / "adapter.safetensors").read_bytes() == _library_bytes(tensors)
