"""The sliced HF load of both bridges gives bit for bit what each library's own loader gives, every rank reading
only the slices of the checkpoint it holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron.bridges import create_bridge
from lightning_megatron.hf_io import checkpoint_tensor_specs
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.vl import VL_FAMILIES, make_tiny_vl_checkpoint
from tests._distributed import run_distributed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliced_load")
    return {
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3"),
        "qwen3_tied": make_tiny_checkpoint(root / "qwen3_tied", "qwen3", tied=True),
        "qwen3_bf16": make_tiny_checkpoint(root / "qwen3_bf16", "qwen3", dtype=torch.bfloat16),
        "qwen3_mtp": make_tiny_checkpoint(root / "qwen3_mtp", "qwen3", mtp=True),
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2"),
        "mimo": make_tiny_checkpoint(root / "mimo", "mimo", mtp=True),
        "qwen3_moe": make_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe"),
        "qwen2_moe": make_tiny_checkpoint(root / "qwen2_moe", "qwen2_moe"),
    }


def _load(bridge: Any, chunks: list[torch.nn.Module], *, sliced: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """Every parameter set to NaN, then loaded: one the load misses can never compare equal."""
    with torch.no_grad():
        for chunk in chunks:
            for parameter in chunk.parameters():
                parameter.fill_(float("nan"))
    report = bridge.load_hf_weights(chunks, sliced=sliced)
    return report, {f"{index}.{name}": parameter.detach().clone()
                    for index, chunk in enumerate(chunks) for name, parameter in chunk.named_parameters()}


@contextlib.contextmanager
def _an_unknown_bridge_class(bridge: Any) -> Iterator[None]:
    """The library's bridge class for this model overrides how HF tensors become Megatron ones (with the same code,
    or handing back copies): the package cannot know such a conversion, so every parameter must go through the
    library's own."""
    if bridge.name == "mbridge":
        library_class, name = type(bridge._auto_bridge), "_weight_to_mcore_format"
        convert = library_class._weight_to_mcore_format

        def override(self: Any, mcore_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
            return convert(self, mcore_name, hf_weights)
    else:
        library_class, name = type(bridge.auto_bridge._model_bridge), "maybe_modify_loaded_hf_weight"
        load = library_class.maybe_modify_loaded_hf_weight

        def override(self: Any, hf_param: Any, state: Any) -> Any:
            weights = load(self, hf_param, state)
            return {key: value.clone() for key, value in weights.items()} if isinstance(weights, dict) \
                else weights.clone()
    had_own = name in vars(library_class)
    original = vars(library_class).get(name)
    setattr(library_class, name, override)
    try:
        yield
    finally:
        if had_own:
            setattr(library_class, name, original)
        else:
            delattr(library_class, name)


def _compare_loads(bridge_type: str, checkpoint: str | Path, mtp: bool = False,
                   params_dtype: torch.dtype = torch.float32, unknown_class: bool = False) -> dict[str, Any]:
    """The sliced load and the library's own load into the same model (current parallel state)."""
    from megatron.core import parallel_state

    bridge = create_bridge(bridge_type, checkpoint, trust_remote_code=Path(checkpoint).name == "mimo")
    sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1 and "moe" in Path(checkpoint).name
    chunks = bridge.build(ModelOptions(mtp=mtp, sequence_parallel=sequence_parallel, params_dtype=params_dtype))
    with _an_unknown_bridge_class(bridge) if unknown_class else contextlib.nullcontext():
        report, sliced = _load(bridge, chunks, sliced=True)
    library_report, library = _load(bridge, chunks, sliced=False)
    return {"report": report, "library_report": library_report, "parameters": sorted(library),
            "unequal": [name for name in library if not torch.equal(sliced[name], library[name])],
            "mtp_parameters": [name for name in library if ".mtp." in name]}


def _assert_same_as_library(result: dict[str, Any]) -> None:
    assert result["unequal"] == []
    assert result["parameters"]
    assert result["library_report"].library and not result["report"].library
    assert result["report"].sliced > 0


def test_reader_slices_count_their_bytes_and_a_plan_that_does_not_add_up_is_refused(tmp_path):
    from safetensors.torch import save_file

    from lightning_megatron.hf_io import CheckpointReader, Piece, Source, checked_pieces

    weight = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    save_file({"w": weight}, tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.read(Source("w", 0, 2, 4)), weight[2:4])
    assert torch.equal(reader.read(Source("w", 1, 1, 3)), weight[:, 1:3])
    assert torch.equal(reader.read(Source("w", 0, 0, 4, (2, 2, 4))), weight[:4].view(2, 2, 4))
    assert reader.bytes_read == (8 + 12 + 16) * 4
    target = torch.empty(3, 4)
    assert checked_pieces([Piece(target, Source("w", 0, 3, 6))], target, reader) is not None
    assert checked_pieces([Piece(target[:2], Source("w", 0, 0, 2))], target, reader) is None  # leaves a row out
    assert checked_pieces([Piece(target, Source("w", 0, 4, 7))], target, reader) is None  # past the end
    assert checked_pieces([Piece(target, Source("w", 1, 0, 3))], target, reader) is None  # wrong shape
    with pytest.raises(KeyError, match="missing"):
        reader.read(Source("missing"))


# one process ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
def test_sliced_load_casts_as_the_library_does(model_parallel, checkpoints, bridge_type, params_dtype):
    """bf16 weights into fp32 parameters (exact) and fp32 weights into bf16 ones (rounded): the same bits."""
    name = "qwen3_bf16" if params_dtype == torch.float32 else "qwen3"
    result = _compare_loads(bridge_type, checkpoints[name], params_dtype=params_dtype)
    _assert_same_as_library(result)
    assert result["report"].converted == 0


@pytest.mark.parametrize(("bridge_type", "name", "mtp"), [
    ("mbridge", "qwen3", False),
    ("mbridge", "qwen3_tied", False),
    ("mbridge", "qwen2", False),  # QKV biases
    ("mbridge", "qwen2_moe", False),  # shared expert, per-expert tensors
    ("mbridge", "qwen3_moe", False),
    ("megatron-bridge", "qwen3", False),
    ("megatron-bridge", "qwen3_tied", False),
    ("megatron-bridge", "qwen3_mtp", True),
    ("megatron-bridge", "mimo", True),  # MiMo's bridge rewrites input_proj as it loads: that one through the library
    ("megatron-bridge", "qwen3_moe", False),
])
def test_sliced_load_equals_the_library_load(model_parallel, checkpoints, bridge_type, name, mtp):
    result = _compare_loads(bridge_type, checkpoints[name], mtp)
    _assert_same_as_library(result)
    assert bool(result["mtp_parameters"]) == mtp
    report = result["report"]
    if name == "mimo":
        assert report.converted == 1  # mtp.layers.0.eh_proj.weight, from the swapped input_proj halves
    else:
        assert report.converted == 0  # every stock mapping is read as slices
    total = sum(spec.nbytes for spec in checkpoint_tensor_specs(checkpoints[name]).values())
    assert report.bytes_read == total  # one process reads each tensor once


@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
def test_a_conversion_the_package_does_not_know_goes_through_the_library(model_parallel, checkpoints, bridge_type):
    result = _compare_loads(bridge_type, checkpoints["qwen3_tied"], unknown_class=True)
    assert result["unequal"] == [] and result["parameters"]
    assert result["report"].sliced == 0 and result["report"].converted == len(result["parameters"])


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_sliced_load_of_a_vision_language_model_equals_the_library_load(model_parallel, tmp_path, family):
    result = _compare_loads("megatron-bridge", make_tiny_vl_checkpoint(tmp_path / family, family))
    _assert_same_as_library(result)
    assert any(".vision" in name or "visual" in name for name in result["parameters"])


@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
def test_hf_path_loads_another_checkpoint_into_the_built_model(model_parallel, checkpoints, tmp_path, bridge_type):
    other = make_tiny_checkpoint(tmp_path / "qwen3_seed1", "qwen3", seed=1)
    bridge = create_bridge(bridge_type, checkpoints["qwen3"])
    chunks = bridge.build(ModelOptions())
    built = {name: parameter.detach().clone() for name, parameter in chunks[0].named_parameters()}
    report = bridge.load_hf_weights(chunks, other)
    sliced = {name: parameter.detach().clone() for name, parameter in chunks[0].named_parameters()}
    bridge.load_hf_weights(chunks, other, sliced=False)
    assert report.sliced
    assert all(torch.equal(sliced[name], parameter) for name, parameter in chunks[0].named_parameters())
    assert not any(torch.equal(sliced[name], built[name]) for name in built if name.endswith("linear_fc1.weight"))


@pytest.mark.gpu
@pytest.mark.parametrize("staging_bytes", [2048, 16 * 1024**2])
def test_sliced_load_onto_the_gpu_equals_the_library_conversion(model_parallel, checkpoints, monkeypatch,
                                                                 staging_bytes):
    """Through the pinned staging buffers: 2 KiB ones copy each tensor in many chunks (and send rows bigger than a
    buffer straight), 16 MiB ones each tiny tensor in one. The reference is megatron-bridge's own loader, and
    mbridge's own conversion of every parameter (its loader scatters even at TP=1, which gloo cannot do with CUDA
    tensors; the CPU tests show that conversion equals its loader)."""
    from lightning_megatron import hf_io

    monkeypatch.setattr(hf_io, "STAGING_BYTES", staging_bytes)
    for bridge_type, name, mtp in [("mbridge", "qwen3_tied", False), ("megatron-bridge", "qwen3_mtp", True)]:
        for params_dtype in (torch.float32, torch.bfloat16):  # bf16: fp32 weights rounded
            bridge = create_bridge(bridge_type, checkpoints[name])
            chunks = bridge.build(ModelOptions(mtp=mtp, params_dtype=params_dtype))
            assert next(chunks[0].parameters()).is_cuda
            report, sliced = _load(bridge, chunks, sliced=True)
            if bridge_type == "mbridge":
                with _an_unknown_bridge_class(bridge):
                    reference_report, reference = _load(bridge, chunks, sliced=True)
                assert reference_report.sliced == 0
            else:
                _, reference = _load(bridge, chunks, sliced=False)
            assert report.converted == 0
            assert [name for name in reference if not torch.equal(sliced[name], reference[name])] == []


# two processes -------------------------------------------------------------------------------------------------------

_DISTRIBUTED_CASES = {  # (bridge, checkpoint, mtp) per layout
    "tp2": [("mbridge", "qwen3", False), ("mbridge", "qwen3_tied", False), ("megatron-bridge", "qwen3_mtp", True),
            ("megatron-bridge", "qwen3_tied", False), ("mbridge", "unknown_class", False),
            ("megatron-bridge", "unknown_class", False)],
    "pp2": [("mbridge", "qwen3", False), ("mbridge", "qwen3_tied", False), ("megatron-bridge", "qwen3_mtp", True),
            ("megatron-bridge", "qwen3_tied", False)],
    "ep2": [("mbridge", "qwen3_moe", False), ("megatron-bridge", "qwen3_moe", False)],
}
_LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2),
            "ep2": dict(expert_model_parallel_size=2)}


def _compare_in_each_layout(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    results: dict[str, Any] = {}
    for layout, cases in _DISTRIBUTED_CASES.items():
        parallel_state.initialize_model_parallel(**_LAYOUTS[layout])
        tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        for bridge_type, name, mtp in cases:
            unknown_class = name == "unknown_class"  # every parameter through the library's conversion and scatter
            checkpoint = paths["qwen3" if unknown_class else name]
            results[layout, bridge_type, name] = _compare_loads(bridge_type, checkpoint, mtp,
                                                                unknown_class=unknown_class)
        parallel_state.destroy_model_parallel()
    return results


@pytest.mark.slow
def test_sliced_load_equals_the_library_load_on_two_ranks_reading_their_own_slices(checkpoints, tmp_path):
    """TP=2, PP=2 and EP=2 in the same two processes; with TP=2 each rank reads half of every matrix (and each
    norm whole), so both ranks together read the checkpoint's matrices once."""
    paths = {name: str(path) for name, path in checkpoints.items()}
    results = run_distributed(_compare_in_each_layout, tmp_path, paths)
    for key in results[0]:
        layout, bridge_type, name = key
        if name == "unknown_class":
            assert all(result[key]["unequal"] == [] and result[key]["report"].sliced == 0 for result in results)
            continue
        for result in results:
            _assert_same_as_library(result[key])
            assert result[key]["report"].converted == 0
        mtp = name == "qwen3_mtp"
        if layout != "pp2":
            assert all(bool(result[key]["mtp_parameters"]) == mtp for result in results)
        else:  # the MTP head lives on the last stage
            assert [bool(result[key]["mtp_parameters"]) for result in results] == [False, mtp]
        if layout == "tp2":
            specs = checkpoint_tensor_specs(checkpoints[name]).values()
            matrices = sum(spec.nbytes for spec in specs if len(spec.shape) > 1)
            norms = sum(spec.nbytes for spec in specs if len(spec.shape) == 1)
            read = [result[key]["report"].bytes_read for result in results]
            assert sum(read) == matrices + 2 * norms, key
            assert max(read) < 0.6 * (matrices + norms), key
