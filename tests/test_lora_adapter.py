"""The PEFT adapter file a weight sync writes every few steps: streamed from the export into the layout of the last
write, it is byte for byte what safetensors itself writes of megatron-bridge's PEFT state, at every write, after the
adapters trained on, and after another set of adapters (a new layout); from the second write of a set of adapters on,
a model whole on its rank copies the file's bytes from the parameters without exporting (`_CopyPlan`), and falls back
to the export where its parameters moved or the export is more than pieces of them; `peft` loads it onto the HF
model with the Megatron model's logits. (A fit's export of both forms: tests/test_lora.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from lightning_megatron import lora
from lightning_megatron._compat import import_peft
from lightning_megatron.bridges import Bridge, create_bridge
from lightning_megatron.lora import LoRAConfig, add_lora_adapters, write_lora_adapter
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

SEQ, VOCAB = 16, 384


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lora_adapter") / "qwen3", "qwen3")


def _adapted(bridge: Bridge, config: LoRAConfig, seed: int) -> list[torch.nn.Module]:
    """A model with adapters whose B is not zero (a fresh one's is: the adapters would change nothing)."""
    chunks = bridge.build(ModelOptions())
    add_lora_adapters(chunks, config)
    _train(chunks, seed)
    return chunks


def _train(chunks: list[torch.nn.Module], seed: int) -> None:
    """New values in every adapter, as training steps give them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for name, parameter in chunk.named_parameters():
                if ".adapter." in name:
                    parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))


def _library_file(bridge: Bridge, chunks: list[torch.nn.Module]) -> bytes:
    """What the adapter file was before it streamed: megatron-bridge's PEFT state of host copies, by safetensors."""
    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple
    from megatron.bridge.models.conversion.peft_bridge import convert_adapter_weights_to_peft_state

    exported = [HFWeightTuple(name, tensor.detach().cpu().clone()) for name, tensor in
                bridge.export_adapter_weights(chunks)]
    state, _, _ = convert_adapter_weights_to_peft_state(exported)
    return save(state, metadata={"format": "pt"})


def test_every_adapter_file_is_safetensors_own_bytes_whether_streamed_or_laid_out_afresh(model_parallel, checkpoint,
                                                                                       tmp_path, monkeypatch):
    layouts: list[int] = []  # new layouts made, per write
    real_layout = lora.safetensors_layout
    monkeypatch.setattr(lora, "safetensors_layout", lambda specs: layouts.append(1) or real_layout(specs))
    bridge = create_bridge("megatron-bridge", checkpoint)
    exports = _count_exports(bridge, monkeypatch)
    every_linear = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    qkv_only = _adapted(bridge, LoRAConfig(target_modules=["linear_qkv"], rank=8, alpha=32), seed=1)
    configs = []
    for step, (chunks, new_layout) in enumerate([(every_linear, True), (every_linear, False), (every_linear, False),
                                                 (qkv_only, True), (every_linear, True)]):
        if step == 2:
            _train(every_linear, seed=2)  # the same adapters, other values: streamed into the same layout
        exports.clear()
        folder = write_lora_adapter(bridge, chunks, tmp_path / f"v{step}", extra_files={"note.json": "{}\n"})
        assert len(exports) == (3 if new_layout else 0), step  # the write's export and the two probes, or none
        assert (folder / "adapter_model.safetensors").read_bytes() == _library_file(bridge, chunks), step
        assert len(layouts) == new_layout, step
        assert sorted(path.name for path in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                  "note.json"]
        configs.append(json.loads((folder / "adapter_config.json").read_text()))
        layouts.clear()
    assert (tmp_path / "v1" / "adapter_model.safetensors").read_bytes() != \
        (tmp_path / "v2" / "adapter_model.safetensors").read_bytes()
    assert configs[0] == configs[1] == configs[2] == configs[4]
    assert (configs[0]["r"], configs[0]["lora_alpha"], len(configs[0]["target_modules"])) == (4, 8, 7)
    assert (configs[3]["r"], configs[3]["lora_alpha"]) == (8, 32)
    assert sorted(configs[3]["target_modules"]) == ["k_proj", "q_proj", "v_proj"]


def test_a_repeated_write_goes_into_the_spare_file_prepared_after_the_last_and_no_spare_outlives_its_plan(
        model_parallel, checkpoint, tmp_path):
    """From the copy plan's first write on, the next adapter file is preallocated beside the folders (hidden), and
    the next write renames it into its folder and writes over it: the same inode, safetensors' own bytes of the
    adapters as trained since."""
    import gc

    from lightning_megatron.atomic import SPARE_FILE_PREFIX
    from lightning_megatron.lora_folder import ADAPTER_FILE

    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    write_lora_adapter(bridge, chunks, tmp_path / "v0")  # exported, then probed: no copy plan write yet
    assert list(tmp_path.glob(f"{SPARE_FILE_PREFIX}*")) == []
    write_lora_adapter(bridge, chunks, tmp_path / "v1")  # the plan's first write
    spare = lora._COPY_PLANS[bridge].spare.wait()
    assert list(tmp_path.glob(f"{SPARE_FILE_PREFIX}*")) == [spare]
    assert lora.next_adapter_file(bridge) is not None  # the next write copies into its pages
    assert spare.stat().st_size == (tmp_path / "v1" / ADAPTER_FILE).stat().st_size
    inode = spare.stat().st_ino
    _train(chunks, seed=3)
    folder = write_lora_adapter(bridge, chunks, tmp_path / "v2")
    assert (folder / ADAPTER_FILE).stat().st_ino == inode
    assert (folder / ADAPTER_FILE).read_bytes() == _library_file(bridge, chunks)
    assert [path.name for path in tmp_path.glob(f"{SPARE_FILE_PREFIX}*")] != [spare.name]  # the next one, prepared
    del lora._COPY_PLANS[bridge]
    gc.collect()
    assert list(tmp_path.glob(f"{SPARE_FILE_PREFIX}*")) == []


def _mapped(path: Path) -> bool:
    """Whether this process maps `path` (Linux's /proc/self/maps)."""
    return any(line.rstrip("\n").endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_spare_is_mapped_with_its_header_takes_the_bytes_into_its_pages_and_lets_go_of_them_once_written(tmp_path):
    """The next file's header is in place before the write, the write is a copy into the mapped pages, and the
    mapping goes with the next preparation (the file keeps the bytes); a spare of another size is not taken."""
    from lightning_megatron.lora_folder import ADAPTER_FILE, SpareFile

    prefix, data = b"a header", torch.arange(100, dtype=torch.uint8)
    size = len(prefix) + data.numel()
    spare = SpareFile()
    spare.prepare(tmp_path, prefix, size, register=False)
    spare.wait()  # a write that comes before the preparation ends goes without the spare (the next test)
    (tmp_path / "v0").mkdir()
    mapping = spare.move_to(tmp_path / "v0" / ADAPTER_FILE, size)
    assert mapping is not None and not mapping.registered and _mapped(tmp_path / "v0" / ADAPTER_FILE)
    mapping.pages[len(prefix):].copy_(data)
    assert (tmp_path / "v0" / ADAPTER_FILE).read_bytes() == prefix + bytes(range(100))
    spare.prepare(tmp_path, prefix, size, register=False)
    next_spare = spare.wait()
    assert next_spare is not None and _mapped(next_spare) and not _mapped(tmp_path / "v0" / ADAPTER_FILE)
    assert next_spare.read_bytes()[:len(prefix)] == prefix
    (tmp_path / "v1").mkdir()
    assert spare.move_to(tmp_path / "v1" / ADAPTER_FILE, size + 1) is None  # another size: removed, unmapped
    assert not next_spare.exists() and not _mapped(next_spare) and not (tmp_path / "v1" / ADAPTER_FILE).exists()
    assert (tmp_path / "v0" / ADAPTER_FILE).read_bytes() == prefix + bytes(range(100))


def test_a_write_right_after_the_last_does_not_wait_for_the_spare_which_serves_the_next_write(tmp_path, monkeypatch):
    """Syncs back to back: the spare's preparation (held here until released) has not ended when the next write
    comes; that write goes without it at once, the spare is kept (not prepared twice) and the write after takes it.
    Other settings replace it."""
    import threading

    from lightning_megatron import lora_folder
    from lightning_megatron.atomic import SPARE_FILE_PREFIX
    from lightning_megatron.lora_folder import ADAPTER_FILE, SpareFile

    released, started = threading.Event(), []
    preallocate = lora_folder.preallocate_spare

    def held_preallocation(*arguments):
        started.append(arguments)
        return preallocate(*arguments) if released.wait(30) else None

    monkeypatch.setattr(lora_folder, "preallocate_spare", held_preallocation)
    prefix, size = b"a header", 108
    spare = SpareFile()
    spare.prepare(tmp_path, prefix, size, register=False)
    for version in ("v0", "v1"):
        (tmp_path / version).mkdir()
    assert spare.move_to(tmp_path / "v0" / ADAPTER_FILE, size) is None  # not waited for
    spare.prepare(tmp_path, prefix, size, register=False)  # the same settings: kept
    released.set()
    prepared = spare.wait()
    assert len(started) == 1  # one preparation served both prepares, none timed out waiting
    assert prepared is not None and list(tmp_path.glob(f"{SPARE_FILE_PREFIX}*")) == [prepared]
    mapping = spare.move_to(tmp_path / "v1" / ADAPTER_FILE, size)
    assert mapping is not None and (tmp_path / "v1" / ADAPTER_FILE).read_bytes()[:len(prefix)] == prefix
    spare.prepare(tmp_path, prefix, size, register=False)
    first = spare.wait()
    spare.prepare(tmp_path, prefix, size + 1, register=False)  # other settings: the pending spare goes
    second = spare.wait()
    assert first is not None and not first.exists() and list(tmp_path.glob(f"{SPARE_FILE_PREFIX}*")) == [second]
    spare.discard()


def _count_exports(bridge: Bridge, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per export of the adapters through megatron-bridge (the real one runs)."""
    calls: list[int] = []
    real_export = bridge.export_adapter_weights
    monkeypatch.setattr(bridge, "export_adapter_weights",
                        lambda chunks, **options: calls.append(1) or real_export(chunks, **options))
    return calls


def test_the_copy_plan_pieces_a_fused_qkv_per_group_and_survives_nothing_it_cannot_see(model_parallel, checkpoint,
                                                                                       tmp_path, monkeypatch):
    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    exports = _count_exports(bridge, monkeypatch)
    write_lora_adapter(bridge, chunks, tmp_path / "v0")
    plan = lora._COPY_PLANS[bridge]
    groups = chunks[0].config.num_query_groups
    # per layer: 4 linears' A and B, gate/up each its half of fc1's B, q, k, v of each query group
    layers = len(chunks[0].decoder.layers)
    assert len(plan.pieces) == layers * (2 * 4 + 1 + 3 * groups - 1 + 2 + 1), len(plan.pieces)
    weight = next(module for module in chunks[0].modules() if type(module).__name__ == "LoRALinear").adapter.linear_out
    for step in (1, 2):  # a parameter's memory moves (a reload, an offload): the plan no longer sees it
        with torch.no_grad():
            weight.weight.data = weight.weight.data.clone() + 1
        exports.clear()
        folder = write_lora_adapter(bridge, chunks, tmp_path / f"v{step}")
        assert len(exports) == 3 and lora._COPY_PLANS[bridge] is not plan, step  # exported, probed again
        assert (folder / "adapter_model.safetensors").read_bytes() == _library_file(bridge, chunks), step
        plan = lora._COPY_PLANS[bridge]

    def rounding(chunks: list[torch.nn.Module], **options: object):  # an export that computes: no plan
        for name, tensor in real_export(chunks, **options):
            yield name, tensor.to(torch.bfloat16).to(tensor.dtype)

    real_export = bridge.export_adapter_weights
    monkeypatch.setattr(bridge, "export_adapter_weights", rounding)
    with torch.no_grad():
        weight.weight.data = weight.weight.data.clone()
    write_lora_adapter(bridge, chunks, tmp_path / "v3")
    assert bridge not in lora._COPY_PLANS
    _train(chunks, seed=6)
    exports.clear()
    folder = write_lora_adapter(bridge, chunks, tmp_path / "v4")
    assert (folder / "adapter_model.safetensors").read_bytes() == _library_file(bridge, chunks)


def test_a_streamed_adapter_loads_in_peft_with_the_megatron_logits(model_parallel, checkpoint, tmp_path):
    import transformers

    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    write_lora_adapter(bridge, chunks, tmp_path / "first")
    _train(chunks, seed=3)
    folder = write_lora_adapter(bridge, chunks, tmp_path / "streamed")  # into the first write's layout
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = chunks[0].eval()
    with torch.no_grad():
        megatron = model(input_ids=input_ids, position_ids=torch.arange(SEQ).expand_as(input_ids),
                         attention_mask=None)
        base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        base_logits = base(input_ids).logits
        logits = import_peft().PeftModel.from_pretrained(base, folder).eval()(input_ids).logits
    assert (logits - megatron).abs().max() <= 1e-5  # as tests/test_lora.py bounds the fit's export
    assert (base_logits - megatron).abs().max() > 1e-2  # the adapters do change the model


@pytest.fixture
def ram_folder(tmp_path: Path):
    """A folder in RAM (/dev/shm, tmpfs) where the machine has one, as weight syncs write their versions."""
    import shutil
    import tempfile

    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="lora_adapter_", dir="/dev/shm"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.gpu
def test_a_gpu_models_adapter_file_is_staged_from_the_gpu_with_the_same_bytes(model_parallel, checkpoint, ram_folder):
    """Laid out afresh (staged), then copied from the parameters (the copy plan): staged, then by DMA straight into
    the spare file's pages, registered with CUDA."""
    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    assert next(chunks[0].parameters()).is_cuda
    for step in range(4):
        _train(chunks, seed=step)
        folder = write_lora_adapter(bridge, chunks, ram_folder / f"v{step}")
        assert (folder / "adapter_model.safetensors").read_bytes() == _library_file(bridge, chunks), step
        assert lora._COPY_PLANS[bridge].pieces[0].is_cuda
        mapping = lora.next_adapter_file(bridge)
        assert step == 0 or (mapping is not None and mapping.registered), (step, mapping and mapping.refusal)


def _data_parallel_writes(rank: int, world_size: int, tmp: str, checkpoint: str) -> dict[str, object]:
    from megatron.core import parallel_state

    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    parallel_state.initialize_model_parallel(1, 1)  # two data-parallel replicas, each whole
    bridge = create_bridge("megatron-bridge", Path(checkpoint))
    chunks = _adapted(bridge, LoRAConfig(rank=4, alpha=8), seed=0)
    exports = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _count_exports(bridge, monkeypatch)
        for step in range(3):
            _train(chunks, seed=step)  # the same values on both replicas, as data-parallel training keeps them
            calls.clear()
            write_lora_adapter(bridge, chunks, Path(tmp) / f"v{step}")
            exports.append(len(calls))
    expected = _library_file(bridge, chunks) if rank == 0 else None
    parallel_state.destroy_model_parallel()
    return {"exports": exports, "expected": expected}


@pytest.mark.slow
def test_data_parallel_ranks_agree_on_the_copy_plan_and_rank_0_writes_the_exports_bytes(process_group, checkpoint,
                                                                                          tmp_path):
    from tests._distributed import run_distributed

    ranks = run_distributed(_data_parallel_writes, tmp_path, str(tmp_path), str(checkpoint))
    # rank 0 exports, then probes twice; rank 1 iterates the export (to refuse bad names with rank 0), then skips too
    assert [rank["exports"] for rank in ranks] == [[3, 0, 0], [1, 0, 0]]
    assert (tmp_path / "v2" / "adapter_model.safetensors").read_bytes() == ranks[0]["expected"]
